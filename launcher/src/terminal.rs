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
    /// The settings of stdin when it is a terminal and rsrun runs in its foreground.
    pub fn save() -> Option<SavedTerminal> {
        if !in_foreground() {
            return None;
        }
        read().map(|termios| SavedTerminal { termios })
    }

    /// Puts the settings back if they changed (and rsrun still runs in the terminal's
    /// foreground). Returns whether it did.
    pub fn restore(&self) -> bool {
        if !in_foreground() || read().is_some_and(|now| same(&now, &self.termios)) {
            return false;
        }
        // SAFETY: fd 0 and a termios that tcgetattr filled in; TCSADRAIN lets pending output out.
        unsafe { libc::tcsetattr(0, libc::TCSADRAIN, &self.termios) == 0 }
    }
}
