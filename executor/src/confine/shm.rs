//! The private `/dev/shm` of a confined child under Landlock: a tmpfs of its
//! own in a mount namespace of its own (mounted by the child, `sys`),
//! bounded like its memory, instead of the host's `/dev/shm` that every run
//! and the host share. Without one, the child has no `/dev/shm` at all.

use std::ffi::CString;
use std::path::Path;

use crate::sys;

/// Whether a child can have its own `/dev/shm` here, or why not.
pub fn support() -> Result<(), String> {
    if !Path::new("/dev/shm").is_dir() {
        Err("the host has no /dev/shm".to_string())
    } else {
        sys::private_shm_available()
            .map_err(|e| format!("cannot mount one in a mount namespace of the child's own: {e}"))
    }
}

/// The tmpfs's mount options for a child of `memory_mb` (tmpfs pages count
/// in its cgroup), and the Landlock rights it grants itself on the mount
/// (every right of `landlock_abi`): multiprocessing's semaphores need one.
pub fn mount(memory_mb: u64, landlock_abi: i32) -> (Option<CString>, u64) {
    use landlock::Access as _;
    let mb = memory_mb.max(1);
    (
        CString::new(format!("size={mb}m,nr_inodes=4096,mode=1777")).ok(),
        landlock::AccessFs::from_all(landlock::ABI::from(landlock_abi)).bits(),
    )
}
