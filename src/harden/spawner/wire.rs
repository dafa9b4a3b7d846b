//! Messages between the daemon and the spawner: one JSON document per
//! `SOCK_SEQPACKET` message (the kernel keeps the boundaries, so a
//! message's length is the datagram's and its fds travel with it), file
//! descriptors as `SCM_RIGHTS`.

use serde::{Deserialize, Serialize};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Largest message either side sends or accepts.
pub const MAX_MSG: usize = 64 * 1024;
/// Most fds one message carries.
pub const MAX_FDS: usize = 16;

/// Daemon -> spawner.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Start a process; the message carries `req.fds.len()` fds, in order.
    Spawn {
        id: u64,
        req: Box<super::SpawnRequest>,
    },
    /// Signal a process this spawner started (its group when `group`).
    Kill {
        id: u64,
        pid: i32,
        signal: i32,
        #[serde(default)]
        group: bool,
    },
}

/// Spawner -> daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    /// The process runs (exec succeeded); a pidfd for it is attached.
    Spawned {
        id: u64,
        pid: i32,
    },
    Killed {
        id: u64,
    },
    /// The request failed (`id` 0 when it could not be parsed).
    Error {
        id: u64,
        msg: String,
    },
    /// A child of the spawner ended: one it started (`ours`) or a process
    /// reparented to it as child subreaper (a daemonized VMM).
    Exit {
        pid: i32,
        code: Option<i32>,
        signal: Option<i32>,
        ours: bool,
    },
}

/// Send one message with `fds` attached.
pub fn send(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    if data.is_empty() || data.len() > MAX_MSG || fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "message of {} bytes with {} fds (limits 1..={MAX_MSG}, {MAX_FDS})",
                data.len(),
                fds.len()
            ),
        ));
    }
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; every pointer set below outlives sendmsg.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: the control buffer is `space` bytes, enough for one
        // header with `fds.len()` ints.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c).cast::<RawFd>(),
                fds.len(),
            );
        }
    }
    loop {
        // SAFETY: msg points at live buffers.
        let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One received message.
pub struct Msg {
    pub data: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// Receive one message; `Ok(None)` at end of stream (peer gone). A message
/// that was cut short (too long, too many fds) is an error; its fds are
/// closed.
pub fn recv(sock: RawFd) -> io::Result<Option<Msg>> {
    let mut data = vec![0u8; MAX_MSG];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // SAFETY: pure computation.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: plain data, pointers set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    let n = loop {
        // SAFETY: msg points at live buffers of the stated sizes.
        let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into cbuf.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message truncated (over {MAX_MSG} bytes or {MAX_FDS} fds)"),
        ));
    }
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    data.truncate(n);
    Ok(Some(Msg { data, fds }))
}
