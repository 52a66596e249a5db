//! Reading the small files a daemon or client is configured with (tokens, certificates, keys,
//! passwords) with a deadline: a named pipe (`--token-file <(vault read ...)`) is read like a file,
//! and one nobody writes to fails after [`READ_DEADLINE`] instead of blocking a start (and the stop
//! signals that would end it) forever.

use std::io::{Error, ErrorKind, Read};
use std::path::Path;
use std::time::Duration;

/// How long a configuration file may take to read.
pub const READ_DEADLINE: Duration = Duration::from_secs(10);

/// Largest configuration file read: certificate chains and token tables are far smaller.
const MAX_BYTES: u64 = 16 << 20;

/// Reads `path` whole within [`READ_DEADLINE`].
///
/// # Errors
/// The file cannot be opened or read, is larger than 16 MiB, or gave no end within the deadline
/// (a FIFO without a writer): the error says so.
pub fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    read_within(path, READ_DEADLINE)
}

/// [`read_bounded`] as text.
///
/// # Errors
/// As [`read_bounded`], and contents that are not UTF-8.
pub fn read_bounded_string(path: &Path) -> std::io::Result<String> {
    String::from_utf8(read_bounded(path)?).map_err(|_| Error::new(ErrorKind::InvalidData, "not UTF-8 text"))
}

fn read_within(path: &Path, deadline: Duration) -> std::io::Result<Vec<u8>> {
    // A regular file cannot block: read it here.
    if std::fs::metadata(path)?.is_file() {
        return read_all(path);
    }
    // A pipe or device may: a thread of its own reads it (left behind, blocked, if the deadline
    // passes; the caller is failing then anyway).
    let (tx, rx) = std::sync::mpsc::channel();
    let owned = path.to_path_buf();
    std::thread::Builder::new().name("read-config".into()).spawn(move || {
        let _ = tx.send(read_all(&owned));
    })?;
    rx.recv_timeout(deadline).unwrap_or_else(|_| {
        Err(Error::new(
            ErrorKind::TimedOut,
            format!("nothing to read within {deadline:?} (a named pipe that nobody writes to?)"),
        ))
    })
}

fn read_all(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    std::fs::File::open(path)?.take(MAX_BYTES + 1).read_to_end(&mut out)?;
    if out.len() as u64 > MAX_BYTES {
        return Err(Error::new(ErrorKind::InvalidData, format!("larger than {MAX_BYTES} bytes: not a configuration file")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_pipes_are_read_and_a_pipe_without_writer_fails_in_time() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "abc\n").unwrap();
        assert_eq!(read_bounded_string(&file).unwrap(), "abc\n");
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = read_within(&fifo, Duration::from_millis(200)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut);
        assert!(e.to_string().contains("named pipe"), "{e}");
        // With a writer, a pipe reads like a file (another pipe: the reader left blocked on the
        // first one would take its data).
        let fifo = dir.path().join("fifo2");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::write(fifo, "from a pipe").unwrap())
        };
        assert_eq!(read_within(&fifo, Duration::from_secs(30)).unwrap(), b"from a pipe");
        writer.join().unwrap();
        assert!(read_bounded(dir.path()).is_err(), "a directory is no file");
        assert!(read_bounded(&dir.path().join("missing")).unwrap_err().kind() == ErrorKind::NotFound);
    }
}
