//! seccomp, the system-call fence of a confined child: the programs compiled
//! once per tool (the dangerous calls denied with EPERM, unix sockets but
//! stream and seqpacket pairs, namespace flags of `clone`, `clone3` failing
//! with ENOSYS, the x32 ABI guarded), and a fork server's, which keeps what
//! its children need before they install their own.

use std::collections::BTreeMap;
use std::sync::Arc;

/// Whether the kernel has seccomp filters.
pub fn support() -> Result<String, String> {
    if crate::sys::seccomp_available() {
        Ok(
            "filter compiled once per tool, denied calls fail with EPERM; no unix sockets but stream socketpairs"
                .into(),
        )
    } else {
        Err("the kernel has no seccomp".into())
    }
}

/// The seccomp programs: one denying the listed calls with EPERM, one making
/// `clone3` fail with ENOSYS (its flags live in memory a filter cannot read,
/// so libc falls back to `clone`, whose flags the first program checks).
pub fn programs() -> Result<Vec<Arc<Vec<seccompiler::sock_filter>>>, seccompiler::BackendError> {
    programs_for(Filtered::Child)
}

/// Who a seccomp program set is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Filtered {
    /// A tool's child: every call of `DENIED_SYSCALLS`, and the rules below.
    Child,
    /// A tool's fork server: the same, but for what its children need
    /// before they install their own (joining a network namespace,
    /// `unshare(CLONE_NEWNS)` and `mount` for a private `/dev/shm`) and what
    /// it needs to fork them (`clone` with `CLONE_NEWPID`).
    ForkServer,
}

/// The programs a tool's fork server runs under: the union of what its
/// children get (their own filters then take the rest away).
pub fn fork_server_programs() -> Result<Vec<Arc<Vec<seccompiler::sock_filter>>>, seccompiler::BackendError> {
    programs_for(Filtered::ForkServer)
}

/// Calls a fork server keeps and its children's filters deny.
const FORK_SERVER_NEEDS: [i64; 3] = [libc::SYS_setns, libc::SYS_unshare, libc::SYS_mount];

fn programs_for(who: Filtered) -> Result<Vec<Arc<Vec<seccompiler::sock_filter>>>, seccompiler::BackendError> {
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompFilter,
        SeccompRule, TargetArch,
    };
    let arch = TargetArch::try_from(std::env::consts::ARCH)?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in DENIED_SYSCALLS {
        if who == Filtered::ForkServer && FORK_SERVER_NEEDS.contains(nr) {
            continue;
        }
        rules.insert(*nr, Vec::new());
    }
    // socket(2): only AF_INET and AF_INET6, and never raw or packet types.
    // No AF_UNIX: Landlock does not mediate connect(2) to a socket file, nor
    // sendto(2) naming one, so a unix socket the child could create could
    // reach every world-writable socket of the host (D-Bus, X11, docker.sock).
    let family_not = |f: i32| Cond::new(0, Len::Dword, Op::Ne, f as u64);
    let socket_rules = vec![
        SeccompRule::new(vec![family_not(libc::AF_INET)?, family_not(libc::AF_INET6)?])?,
        SeccompRule::new(vec![Cond::new(
            1,
            Len::Dword,
            Op::MaskedEq(0xf),
            libc::SOCK_RAW as u64,
        )?])?,
        SeccompRule::new(vec![Cond::new(
            1,
            Len::Dword,
            Op::MaskedEq(0xf),
            10, /* SOCK_PACKET */
        )?])?,
    ];
    rules.insert(libc::SYS_socket, socket_rules);
    // socketpair(2): runtimes make their own pipes with it (Node's and
    // libuv's child stdio and IPC, Python's `socketpair`, multiprocessing's
    // duplex `Pipe`). Only AF_UNIX stream and seqpacket pairs: those cannot
    // be re-targeted (connect fails with EISCONN, a destination address is
    // refused or ignored). A datagram pair could `sendto`/`connect` any host
    // datagram socket, and AF_UNIX treats SOCK_RAW as a datagram socket.
    let mut pair_rules = vec![SeccompRule::new(vec![family_not(libc::AF_UNIX)?])?];
    for ty in 0..=0xf_u64 {
        if ty != libc::SOCK_STREAM as u64 && ty != libc::SOCK_SEQPACKET as u64 {
            pair_rules.push(SeccompRule::new(vec![Cond::new(
                1,
                Len::Dword,
                Op::MaskedEq(0xf),
                ty,
            )?])?);
        }
    }
    rules.insert(libc::SYS_socketpair, pair_rules);
    // clone(2) with any namespace flag.
    let mut clone_rules = Vec::new();
    for flag in [
        libc::CLONE_NEWNS,
        libc::CLONE_NEWUTS,
        libc::CLONE_NEWIPC,
        libc::CLONE_NEWUSER,
        libc::CLONE_NEWPID,
        libc::CLONE_NEWNET,
        libc::CLONE_NEWCGROUP,
    ] {
        if who == Filtered::ForkServer && flag == libc::CLONE_NEWPID {
            continue;
        }
        let f = flag as u64;
        clone_rules.push(SeccompRule::new(vec![Cond::new(0, Len::Qword, Op::MaskedEq(f), f)?])?);
    }
    rules.insert(libc::SYS_clone, clone_rules);
    let eperm = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )?;
    let mut clone3 = BTreeMap::new();
    clone3.insert(libc::SYS_clone3, Vec::new());
    let enosys = SeccompFilter::new(
        clone3,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )?;
    let a: seccompiler::BpfProgram = eperm.try_into()?;
    let b: seccompiler::BpfProgram = enosys.try_into()?;
    let mut programs = vec![Arc::new(a), Arc::new(b)];
    if let Some(x32) = x32_guard() {
        programs.push(Arc::new(x32));
    }
    Ok(programs)
}

/// On x86_64, system calls of the x32 ABI carry the x86_64 audit arch with
/// bit 30 set in their number, so no rule above matches them (`socket` is
/// 41 there, `41 | 1 << 30` in x32). Kernels with x32 enabled would let
/// them through: they fail with ENOSYS, as on a kernel without x32.
fn x32_guard() -> Option<seccompiler::BpfProgram> {
    #[cfg(target_arch = "x86_64")]
    {
        use seccompiler::sock_filter;
        const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
        const X32_SYSCALL_BIT: u32 = 0x4000_0000;
        let stmt = |code: u32, k: u32| sock_filter {
            code: code as u16,
            jt: 0,
            jf: 0,
            k,
        };
        let jump = |code: u32, k: u32, jt: u8, jf: u8| sock_filter {
            code: code as u16,
            jt,
            jf,
            k,
        };
        Some(vec![
            // seccomp_data.arch (offset 4): not x86_64 → allow (the main
            // program already kills every foreign arch).
            stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 4),
            jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, AUDIT_ARCH_X86_64, 0, 3),
            // seccomp_data.nr (offset 0): x32 numbers fail.
            stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
            jump(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, X32_SYSCALL_BIT, 0, 1),
            stmt(
                libc::BPF_RET | libc::BPF_K,
                libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
            ),
            stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW),
        ])
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// System calls a confined child may not make at all (they fail with EPERM).
pub const DENIED_SYSCALLS: &[i64] = &[
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_userfaultfd,
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs classic BPF `prog` on a `seccomp_data` (the instructions
    /// seccompiler emits, and `x32_guard`'s).
    fn run_bpf(prog: &[seccompiler::sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let mut data = Vec::with_capacity(64);
        data.extend_from_slice(&nr.to_le_bytes());
        data.extend_from_slice(&arch.to_le_bytes());
        data.extend_from_slice(&0u64.to_le_bytes());
        for a in args {
            data.extend_from_slice(&a.to_le_bytes());
        }
        let (mut acc, mut pc) = (0u32, 0usize);
        loop {
            let i = &prog[pc];
            let code = u32::from(i.code);
            pc += 1;
            match code {
                c if c == libc::BPF_LD | libc::BPF_W | libc::BPF_ABS => {
                    let at = i.k as usize;
                    acc = u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
                }
                c if c == libc::BPF_ALU | libc::BPF_AND | libc::BPF_K => acc &= i.k,
                c if c == libc::BPF_JMP | libc::BPF_JA => pc += i.k as usize,
                c if c & 0x07 == libc::BPF_JMP => {
                    let taken = match c & 0xf0 {
                        0x10 => acc == i.k,     // JEQ
                        0x20 => acc > i.k,      // JGT
                        0x30 => acc >= i.k,     // JGE
                        0x40 => acc & i.k != 0, // JSET
                        other => panic!("jump {other:#x}"),
                    };
                    pc += usize::from(if taken { i.jt } else { i.jf });
                }
                c if c & 0x07 == libc::BPF_RET => return i.k,
                other => panic!("opcode {other:#x}"),
            }
        }
    }

    /// What the child's filters answer for one call: the first program that
    /// does not allow it decides (enough for these cases).
    fn verdict(arch: u32, nr: i64, args: [u64; 6]) -> u32 {
        let programs = programs().unwrap();
        programs
            .iter()
            .map(|p| run_bpf(p, arch, nr as u32, args))
            .find(|r| *r != libc::SECCOMP_RET_ALLOW)
            .unwrap_or(libc::SECCOMP_RET_ALLOW)
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn unix_sockets_are_denied_but_stream_socketpairs_stay() {
        const ARCH: u32 = 0xc000_003e;
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let enosys = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
        let allow = libc::SECCOMP_RET_ALLOW;
        let call = |nr: i64, a: i32, b: i32| verdict(ARCH, nr, [a as u64, b as u64, 0, 0, 0, 0]);
        let (unix, inet, inet6) = (libc::AF_UNIX, libc::AF_INET, libc::AF_INET6);
        let (stream, dgram, seq, raw) = (
            libc::SOCK_STREAM,
            libc::SOCK_DGRAM,
            libc::SOCK_SEQPACKET,
            libc::SOCK_RAW,
        );
        let flags = libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
        for (what, nr, family, ty, want) in [
            ("socket unix stream", libc::SYS_socket, unix, stream, eperm),
            ("socket unix dgram", libc::SYS_socket, unix, dgram | flags, eperm),
            ("socket unix seqpacket", libc::SYS_socket, unix, seq, eperm),
            ("socket netlink", libc::SYS_socket, libc::AF_NETLINK, dgram, eperm),
            ("socket inet stream", libc::SYS_socket, inet, stream | flags, allow),
            ("socket inet6 dgram", libc::SYS_socket, inet6, dgram, allow),
            ("socket inet raw", libc::SYS_socket, inet, raw, eperm),
            (
                "socketpair unix stream",
                libc::SYS_socketpair,
                unix,
                stream | flags,
                allow,
            ),
            (
                "socketpair unix seqpacket",
                libc::SYS_socketpair,
                unix,
                seq | libc::SOCK_CLOEXEC,
                allow,
            ),
            ("socketpair unix dgram", libc::SYS_socketpair, unix, dgram, eperm),
            (
                "socketpair unix dgram cloexec",
                libc::SYS_socketpair,
                unix,
                dgram | flags,
                eperm,
            ),
            ("socketpair unix raw", libc::SYS_socketpair, unix, raw, eperm),
            ("socketpair unix type 0", libc::SYS_socketpair, unix, 0, eperm),
            ("socketpair inet stream", libc::SYS_socketpair, inet, stream, eperm),
            ("getpid", libc::SYS_getpid, 0, 0, allow),
            ("x32 socket", libc::SYS_socket | 0x4000_0000, unix, stream, enosys),
            (
                "x32 io_uring_setup",
                libc::SYS_io_uring_setup | 0x4000_0000,
                1,
                0,
                enosys,
            ),
        ] {
            assert_eq!(call(nr, family, ty), want, "{what}");
        }
        // A foreign arch (i386 through int 0x80: socketcall and all) is killed.
        assert_eq!(
            verdict(0x4000_0003, 102, [1, 0, 0, 0, 0, 0]),
            libc::SECCOMP_RET_KILL_PROCESS
        );
    }

    /// A fork server keeps what its children need before their own
    /// filters (and to fork them into a PID namespace), and nothing else
    /// its children are denied.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_fork_server_filter_is_the_childrens_but_for_what_they_need_first() {
        const ARCH: u32 = 0xc000_003e;
        let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let server = fork_server_programs().unwrap();
        let verdict = |nr: i64, args: [u64; 6]| {
            server
                .iter()
                .map(|p| run_bpf(p, ARCH, nr as u32, args))
                .find(|r| *r != libc::SECCOMP_RET_ALLOW)
                .unwrap_or(libc::SECCOMP_RET_ALLOW)
        };
        let fork = (libc::CLONE_PARENT | libc::CLONE_NEWPID | libc::SIGCHLD) as u64;
        for (what, nr, args) in [
            ("setns", libc::SYS_setns, [3, libc::CLONE_NEWNET as u64, 0, 0, 0, 0]),
            (
                "unshare(CLONE_NEWNS)",
                libc::SYS_unshare,
                [libc::CLONE_NEWNS as u64, 0, 0, 0, 0, 0],
            ),
            ("mount", libc::SYS_mount, [0; 6]),
            (
                "clone(CLONE_PARENT|CLONE_NEWPID)",
                libc::SYS_clone,
                [fork, 0, 0, 0, 0, 0],
            ),
        ] {
            assert_eq!(verdict(nr, args), libc::SECCOMP_RET_ALLOW, "{what}");
            assert_eq!(self::verdict(ARCH, nr, args), eperm, "{what} is the child's to lose");
        }
        for (what, nr, args) in [
            ("ptrace", libc::SYS_ptrace, [0; 6]),
            ("io_uring_setup", libc::SYS_io_uring_setup, [0; 6]),
            ("bpf", libc::SYS_bpf, [0; 6]),
            (
                "socket(AF_UNIX)",
                libc::SYS_socket,
                [libc::AF_UNIX as u64, 1, 0, 0, 0, 0],
            ),
            (
                "clone(CLONE_NEWUSER)",
                libc::SYS_clone,
                [libc::CLONE_NEWUSER as u64, 0, 0, 0, 0, 0],
            ),
            (
                "clone(CLONE_NEWNET)",
                libc::SYS_clone,
                [libc::CLONE_NEWNET as u64, 0, 0, 0, 0, 0],
            ),
        ] {
            assert_eq!(verdict(nr, args), eperm, "{what}");
        }
    }

    #[test]
    fn seccomp_programs_compile() {
        let p = programs().unwrap();
        assert_eq!(p.len(), if cfg!(target_arch = "x86_64") { 3 } else { 2 });
        assert!(p[0].len() > DENIED_SYSCALLS.len());
    }
}
