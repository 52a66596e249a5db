//! Durable file operations: temp file, fsync, rename, directory fsync.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::CheckpointError;

pub(crate) fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::Io { op, path, source }
}

/// fsyncs a directory (makes renames and creations inside it durable). An empty path is the
/// current directory (the parent of a bare file name).
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("fsync directory", dir))
}

/// Swaps directories `a` and `b` in one step (`renameat2(RENAME_EXCHANGE)`): a crash leaves
/// either both old names or both new ones. `Ok(false)` when the file system cannot
/// (`EINVAL`, `ENOSYS`, `EOPNOTSUPP`: NFS, old kernels); nothing was changed then.
pub(crate) fn exchange(a: &Path, b: &Path) -> Result<bool, CheckpointError> {
    use std::os::unix::ffi::OsStrExt;
    let cstr = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| {
            CheckpointError::InvalidArgument(format!("path {} holds a NUL byte", p.display()))
        })
    };
    let (ca, cb) = (cstr(a)?, cstr(b)?);
    // SAFETY: both pointers are NUL-terminated strings that live across the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => Ok(false),
        _ => Err(io("exchange", a)(err)),
    }
}

/// The temp name used for `path`.
pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Creates `path`'s temp file for writing (truncating a leftover).
pub(crate) fn create_tmp(path: &Path) -> Result<(File, PathBuf), CheckpointError> {
    let tmp = tmp_path(path);
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(io("create", &tmp))?;
    Ok((f, tmp))
}

/// fsyncs `file` (written at `tmp`), renames it to `path` and fsyncs the directory. On error
/// the temp file is removed. An fsync error is never retried (fsyncgate).
pub(crate) fn commit_tmp(file: File, tmp: &Path, path: &Path) -> Result<(), CheckpointError> {
    let r = file.sync_all().map_err(io("fsync", tmp)).and_then(|()| {
        drop(file);
        std::fs::rename(tmp, path).map_err(io("rename", tmp))
    });
    if let Err(e) = r {
        let _ = std::fs::remove_file(tmp);
        return Err(e);
    }
    sync_dir(path.parent().unwrap_or(Path::new("")))
}

/// Writes `bytes` to `path` atomically and durably.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let (mut f, tmp) = create_tmp(path)?;
    if let Err(e) = f.write_all(bytes) {
        drop(f);
        let _ = std::fs::remove_file(&tmp);
        return Err(CheckpointError::Io {
            op: "write",
            path: tmp,
            source: e,
        });
    }
    commit_tmp(f, &tmp, path)
}
