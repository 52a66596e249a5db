//! The terminal's settings, as rsrun found them, put back when it ends.
//!
//! Workers read rsrun's stdin ([`crate::worker`]), so a worker may change the terminal's settings:
//! `getpass` turns echo off while it reads, a curses program enters raw mode. When such a worker
//! dies before it undoes that (a failure elsewhere stops the job while rank 0 waits at a password
//! prompt), the shell is left without echo until the user types `reset`. rsrun saves the settings
//! of a terminal stdin at its start and puts them back at its end if they changed.
//!
//! Only in the terminal's foreground process group: a background rsrun (`&`) that changed a
//! terminal's settings would be stopped by `SIGTTOU`, and the settings are the foreground job's.
//! Not when rsrun's stdout or stderr is a pipe: it may lead to another program of the terminal
//! (`rsrun ... | less`), whose own settings rsrun must neither take nor undo. And only when the
//! job did not end well (a worker failed, or rsrun was stopped): a worker that ran to its end left
//! the settings as it meant to, as the shell itself assumes of a job that exits normally.

/// The settings of rsrun's terminal stdin at its start.
pub struct SavedTerminal {
    termios: libc::termios,
}

impl std::fmt::Debug for SavedTerminal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedTerminal").finish_non_exhaustive()
    }
}

/// Whether stdin is a terminal whose foreground process group is rsrun's.
fn in_foreground() -> bool {
    // SAFETY: isatty, tcgetpgrp and getpgrp take a descriptor number or nothing and only read.
    unsafe { libc::isatty(0) == 1 && libc::tcgetpgrp(0) == libc::getpgrp() }
}

/// Whether descriptor `fd` is a pipe (or FIFO).
fn is_pipe(fd: i32) -> bool {
    // SAFETY: stat is plain data that fstat fills in; fd is a descriptor number.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above, with a pointer to a stat we own.
    unsafe { libc::fstat(fd, &mut st) == 0 && (st.st_mode & libc::S_IFMT) == libc::S_IFIFO }
}

/// Runs `f` with SIGTTOU blocked on this thread: rsrun put in the background between the
/// foreground check and `tcsetattr` (Ctrl-Z, `bg`) then gets the call through instead of being
/// stopped by the terminal.
fn without_sigttou<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: sigset_t is plain data initialised by sigemptyset; pthread_sigmask changes only this
    // thread's mask and is restored right after.
    unsafe {
        let mut block: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut block);
        libc::sigaddset(&mut block, libc::SIGTTOU);
        let blocked = libc::pthread_sigmask(libc::SIG_BLOCK, &block, &mut old) == 0;
        let out = f();
        if blocked {
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        }
        out
    }
}

fn read() -> Option<libc::termios> {
    // SAFETY: termios is plain data (all-zero is a valid value) that tcgetattr fills in.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: fd 0 and a pointer to a termios we own.
    (unsafe { libc::tcgetattr(0, &mut t) } == 0).then_some(t)
}

/// The fields `tcsetattr` sets (the rest of the struct may hold padding or speeds read back
/// differently).
fn same(a: &libc::termios, b: &libc::termios) -> bool {
    a.c_iflag == b.c_iflag && a.c_oflag == b.c_oflag && a.c_cflag == b.c_cflag && a.c_lflag == b.c_lflag && a.c_cc == b.c_cc
}

impl SavedTerminal {
    /// The settings of stdin when it is a terminal, rsrun runs in its foreground, and neither
    /// stdout nor stderr is a pipe (see the module docs).
    pub fn save() -> Option<SavedTerminal> {
        if is_pipe(1) || is_pipe(2) || !in_foreground() {
            return None;
        }
        read().map(|termios| SavedTerminal { termios })
    }

    /// After a job that did not end well: puts the settings back if they changed (and rsrun still
    /// runs in the terminal's foreground). Returns whether it did.
    pub fn restore(&self) -> bool {
        without_sigttou(|| {
            if !in_foreground() || read().is_some_and(|now| same(&now, &self.termios)) {
                return false;
            }
            // SAFETY: fd 0 and a termios that tcgetattr filled in; TCSADRAIN lets pending output
            // out first, as stty does.
            unsafe { libc::tcsetattr(0, libc::TCSADRAIN, &self.termios) == 0 }
        })
    }
}
