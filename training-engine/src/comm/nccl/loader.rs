//! Finds and loads `libnccl` at run time, and holds its entry points.
//!
//! cudarc's own NCCL loader only tries `libnccl.so` and `libnccl.so.<cuda major>`; the library
//! that NVIDIA's packages and pip wheels install is `libnccl.so.2` (the unversioned name comes
//! only with the `-dev` package). So rsrun loads NCCL itself, in this order:
//!
//! 1. `RSRUN_NCCL_LIBRARY`, a path to the library file (an error if it does not load);
//! 2. `libnccl.so.2`, then `libnccl.so`, through the dynamic loader's search (`LD_LIBRARY_PATH`,
//!    the `ldconfig` cache);
//! 3. the copy PyTorch uses: `site-packages/nvidia/*/lib/libnccl.so.2` of the Python environment
//!    in `VIRTUAL_ENV`, in `CONDA_PREFIX` (also its `lib/`), and of the `python3` on `PATH`;
//! 4. `$CUDA_HOME/lib64` and `/usr/local/cuda/lib64`.
//!
//! NCCL ≥ 2.14 is required (non-blocking communicator setup, used to give every wait a deadline).

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::comm::error::{CommError, Result};

/// The environment variable naming the NCCL library file to load.
pub const NCCL_LIBRARY_ENV: &str = "RSRUN_NCCL_LIBRARY";

/// `ncclUniqueId`: 128 opaque bytes, passed by value to `ncclCommInitRankConfig`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawUniqueId {
    pub(crate) internal: [c_char; 128],
}

/// `ncclComm_t`.
pub(crate) type RawComm = *mut c_void;

/// `ncclConfig_t` as of NCCL 2.14 (the first version with it). The struct is versioned and
/// append-only: newer libraries read the fields this version names and default the rest.
#[repr(C)]
pub(crate) struct RawConfig {
    pub(crate) size: usize,
    pub(crate) magic: u32,
    pub(crate) version: u32,
    pub(crate) blocking: c_int,
    pub(crate) cga_cluster_size: c_int,
    pub(crate) min_ctas: c_int,
    pub(crate) max_ctas: c_int,
    pub(crate) net_name: *const c_char,
}

impl RawConfig {
    /// A non-blocking configuration (every other field left to NCCL).
    pub(crate) fn non_blocking() -> Self {
        const UNDEF: c_int = c_int::MIN;
        RawConfig {
            size: std::mem::size_of::<RawConfig>(),
            magic: 0xcafe_beef,
            version: 21403,
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
        }
    }
}

/// `ncclSuccess`.
pub(crate) const SUCCESS: c_int = 0;
/// `ncclInProgress`.
pub(crate) const IN_PROGRESS: c_int = 7;

type Stream = *mut c_void;

/// The loaded library and the entry points rsrun calls.
pub(crate) struct Nccl {
    /// Where the library was found.
    pub(crate) path: String,
    /// `ncclGetVersion`, e.g. 22703 for 2.27.3.
    pub(crate) version: c_int,
    pub(crate) get_unique_id: unsafe extern "C" fn(*mut RawUniqueId) -> c_int,
    pub(crate) comm_init_rank_config:
        unsafe extern "C" fn(*mut RawComm, c_int, RawUniqueId, c_int, *mut RawConfig) -> c_int,
    pub(crate) comm_get_async_error: unsafe extern "C" fn(RawComm, *mut c_int) -> c_int,
    pub(crate) comm_abort: unsafe extern "C" fn(RawComm) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_last_error: Option<unsafe extern "C" fn(RawComm) -> *const c_char>,
    pub(crate) all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        Stream,
    ) -> c_int,
    pub(crate) broadcast:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, Stream) -> c_int,
    pub(crate) all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, Stream) -> c_int,
    pub(crate) reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        Stream,
    ) -> c_int,
    pub(crate) send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, Stream) -> c_int,
    pub(crate) recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, Stream) -> c_int,
    pub(crate) group_start: unsafe extern "C" fn() -> c_int,
    pub(crate) group_end: unsafe extern "C" fn() -> c_int,
    /// Keeps the code the pointers above point into mapped (never dropped: held in a static).
    _lib: libloading::Library,
}

impl Nccl {
    /// `ncclGetErrorString` of `code`, plus the communicator's last error message when known.
    pub(crate) fn describe(&self, code: c_int, comm: Option<RawComm>) -> String {
        // SAFETY: both functions return pointers to static, NUL-terminated strings (or null).
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let mut out = format!("{} (ncclResult {code})", text(unsafe { (self.get_error_string)(code) }));
        if let (Some(last), Some(comm)) = (self.get_last_error, comm) {
            let detail = text(unsafe { last(comm) });
            if !detail.is_empty() {
                out.push_str(": ");
                out.push_str(detail.trim());
            }
        }
        out
    }

    /// The version as `major.minor.patch`.
    pub(crate) fn version_string(&self) -> String {
        version_string(self.version)
    }
}

fn version_string(code: c_int) -> String {
    // NCCL_VERSION(X,Y,Z) = X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after.
    let code = code.max(0);
    if code < 10000 {
        format!("{}.{}.{}", code / 1000, code % 1000 / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100)
    }
}

/// The loaded NCCL, or why it could not be loaded (the outcome is cached for the process).
///
/// # Errors
/// [`CommError::CudaUnavailable`] naming every place that was tried.
pub(crate) fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(load).as_ref().map_err(|e| CommError::CudaUnavailable(e.clone()))
}

fn load() -> std::result::Result<Nccl, String> {
    if let Some(path) = std::env::var_os(NCCL_LIBRARY_ENV) {
        let path = PathBuf::from(path);
        // SAFETY: loading a shared library runs its initialisers; NCCL's are safe to run.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| {
            format!("{NCCL_LIBRARY_ENV}={} does not load: {}", path.display(), dl_error(&e))
        })?;
        return resolve(lib, path.display().to_string());
    }
    let mut tried = Vec::new();
    for name in ["libnccl.so.2", "libnccl.so"] {
        // SAFETY: as above.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return resolve(lib, name.to_string()),
            Err(_) => tried.push(name.to_string()),
        }
    }
    for dir in candidate_dirs() {
        let path = dir.join("libnccl.so.2");
        if !path.is_file() {
            tried.push(path.display().to_string());
            continue;
        }
        // SAFETY: as above.
        match unsafe { libloading::Library::new(&path) } {
            Ok(lib) => return resolve(lib, path.display().to_string()),
            Err(e) => tried.push(format!("{} ({})", path.display(), dl_error(&e))),
        }
    }
    Err(format!(
        "the NCCL library (libnccl.so.2) was not found; tried {}. Install NCCL (libnccl2, or pip's \
         nvidia-nccl-cu12/-cu13 that PyTorch uses), add its directory to LD_LIBRARY_PATH, or set \
         {NCCL_LIBRARY_ENV} to the library file",
        tried.join(", ")
    ))
}

/// A loader error with the dynamic loader's own reason: libloading's `Display` says only
/// "dlopen failed" and keeps `dlerror()`'s text (missing file, wrong ELF class, a missing
/// dependency such as `libcudart.so.12`) in its source.
fn dl_error(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(why) => format!("{e}: {why}"),
        None => e.to_string(),
    }
}

/// Directories that may hold `libnccl.so.2` outside the loader's search path (see the module docs).
fn candidate_dirs() -> Vec<PathBuf> {
    let mut envs: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            envs.push(PathBuf::from(v));
        }
    }
    if let Some(py) = which("python3") {
        // .../bin/python3 → the environment's root.
        if let Some(root) = py.parent().and_then(Path::parent) {
            envs.push(root.to_path_buf());
        }
    }
    let mut dirs = Vec::new();
    for root in &envs {
        dirs.push(root.join("lib"));
        for site in site_packages(root) {
            for entry in read_dir_sorted(&site.join("nvidia")) {
                dirs.push(entry.join("lib"));
            }
        }
    }
    if let Some(cuda) = std::env::var_os("CUDA_HOME").filter(|v| !v.is_empty()) {
        dirs.push(PathBuf::from(cuda).join("lib64"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs.dedup();
    dirs
}

fn site_packages(root: &Path) -> Vec<PathBuf> {
    read_dir_sorted(&root.join("lib"))
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python3")))
        .map(|p| p.join("site-packages"))
        .filter(|p| p.is_dir())
        .collect()
}

fn read_dir_sorted(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    out.sort();
    out
}

fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn resolve(lib: libloading::Library, path: String) -> std::result::Result<Nccl, String> {
    // SAFETY (every `sym` below): the symbol types are the C prototypes of nccl.h for the
    // symbols named; the pointers stay valid while `lib` is mapped, and `lib` moves into the
    // returned struct, which lives in a static for the rest of the process.
    macro_rules! sym {
        ($name:literal) => {
            *unsafe { lib.get($name) }.map_err(|e| {
                format!(
                    "{path} lacks {} ({e}); rsrun needs NCCL 2.14 or newer",
                    String::from_utf8_lossy(&$name[..$name.len() - 1])
                )
            })?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> c_int = sym!(b"ncclGetVersion\0");
    let mut version: c_int = 0;
    // SAFETY: writes one int.
    let rc = unsafe { get_version(&mut version) };
    if rc != SUCCESS {
        return Err(format!("{path}: ncclGetVersion failed with ncclResult {rc}"));
    }
    if version < 21400 {
        return Err(format!(
            "{path} is NCCL {}; rsrun needs NCCL 2.14 or newer",
            version_string(version)
        ));
    }
    let get_last_error = unsafe { lib.get(b"ncclGetLastError\0") }.ok().map(|s| *s);
    Ok(Nccl {
        version,
        get_unique_id: sym!(b"ncclGetUniqueId\0"),
        comm_init_rank_config: sym!(b"ncclCommInitRankConfig\0"),
        comm_get_async_error: sym!(b"ncclCommGetAsyncError\0"),
        comm_abort: sym!(b"ncclCommAbort\0"),
        get_error_string: sym!(b"ncclGetErrorString\0"),
        get_last_error,
        all_reduce: sym!(b"ncclAllReduce\0"),
        broadcast: sym!(b"ncclBroadcast\0"),
        all_gather: sym!(b"ncclAllGather\0"),
        reduce_scatter: sym!(b"ncclReduceScatter\0"),
        send: sym!(b"ncclSend\0"),
        recv: sym!(b"ncclRecv\0"),
        group_start: sym!(b"ncclGroupStart\0"),
        group_end: sym!(b"ncclGroupEnd\0"),
        path,
        _lib: lib,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_nccl_writes_them() {
        assert_eq!(version_string(2708), "2.7.8");
        assert_eq!(version_string(21403), "2.14.3");
        assert_eq!(version_string(22703), "2.27.3");
    }

    #[test]
    fn the_config_has_the_2_14_layout() {
        // size_t, 2 × u32, 4 × int, a pointer: 8 + 8 + 16 + 8.
        assert_eq!(std::mem::size_of::<RawConfig>(), 40);
        assert_eq!(std::mem::size_of::<RawUniqueId>(), 128);
    }

    #[test]
    fn a_library_that_does_not_load_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("libnccl.so.2");
        std::fs::write(&fake, b"not an ELF file").unwrap();
        // SAFETY: the file is not a library, so nothing is mapped or run.
        let err = unsafe { libloading::Library::new(&fake) }.err().expect("a text file must not load");
        let msg = dl_error(&err);
        assert!(msg.starts_with("dlopen failed: "), "{msg}");
        assert!(msg.contains("libnccl.so.2"), "dlerror names the file: {msg}");
    }

    #[test]
    fn pip_layouts_are_searched() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        let found: Vec<PathBuf> = site_packages(dir.path())
            .iter()
            .flat_map(|s| read_dir_sorted(&s.join("nvidia")))
            .map(|p| p.join("lib"))
            .collect();
        assert_eq!(found, vec![lib]);
    }
}
