//! Adopting the protocol descriptors the executor left open in the tool
//! (fds 3 and 4). The crate's only unsafe code.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Take ownership of a descriptor inherited from the parent (the tool side of
/// the protocol: fds 3 and 4). Fails if `fd` is not open.
#[allow(unsafe_code)]
pub(crate) fn adopt_inherited_fd(fd: RawFd) -> io::Result<OwnedFd> {
    if fd < 3 {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "refusing to adopt stdio"));
    }
    // SAFETY: fcntl(F_GETFD) only inspects the descriptor table.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor is open (checked above) and, by the protocol's
    // contract, inherited for this purpose and owned by no other object; the
    // caller adopts each announced descriptor once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_stdio_and_closed_descriptors() {
        assert_eq!(adopt_inherited_fd(1).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert!(adopt_inherited_fd(1_000_000).is_err());
    }
}
