//! [`HugePageAlloc`]: a global allocator that backs large allocations with transparent huge
//! pages, for trainer binaries to install (`#[global_allocator]`).
//!
//! A training step streams hundreds of megabytes of activations, gradients and optimizer state
//! through the cores; with 4 KiB pages most of those accesses also walk the page tables (the
//! second-level TLB covers 8 MiB). Linux backs memory with 2 MiB pages only where the process
//! asks (`transparent_hugepage/enabled = madvise`, the common default), and glibc's allocator
//! does not ask unless `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` is set before the process starts.
//! This allocator asks: an allocation of at least [`THRESHOLD`] bytes gets its own mapping,
//! 2 MiB-aligned and advised `MADV_HUGEPAGE`; everything smaller goes to the system allocator.
//! Freed mappings are kept in a small cache ([`CACHE_SLOTS`] mappings, at most [`CACHE_BYTES`])
//! for the next allocation of the same length, so buffers that are freed and remade every step
//! do not fault their pages in again.
//!
//! The pure core ([`region_len`], [`Cache`]) decides; [`HugePageAlloc`] does the system calls.
//! Where the kernel has transparent huge pages off, the advice is a no-op and the mappings are
//! ordinary pages.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr::null_mut;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

/// The huge page size this allocator aligns to (x86-64 and aarch64 with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;
/// The base page size mappings are rounded to: the kernel backs the whole 2 MiB extents of a
/// mapping with huge pages and its last partial one with base pages, so a buffer costs at most
/// one base page more than its size (64 KiB covers every base page size Linux uses).
pub const BASE_PAGE: usize = 64 << 10;
/// Allocations of at least this many bytes get their own huge-page mapping. Below it the
/// rounding to whole 2 MiB pages would waste more than the pages save.
pub const THRESHOLD: usize = 2 << 20;
/// Freed mappings kept for reuse.
pub const CACHE_SLOTS: usize = 8;
/// Bytes of freed mappings kept for reuse at most.
pub const CACHE_BYTES: usize = 64 << 20;

/// [`ENV_SWITCH`] as the C string `getenv` reads.
const ENV_SWITCH_C: &std::ffi::CStr = c"RSRUN_HUGE_PAGES";

/// The environment variable that turns the allocator off (`0`, `off`, `false` or `no`: every
/// allocation goes to the system allocator) or leaves it on (unset, empty, `1`, `on`, `true`,
/// `yes`), read once, at the first allocation. Any other value ends the process with exit
/// code 2 and a message naming it.
pub const ENV_SWITCH: &str = match ENV_SWITCH_C.to_str() {
    Ok(name) => name,
    Err(_) => panic!("the switch's name is ASCII"),
};

/// The length of the mapping for an allocation of `layout`, or `None` when it belongs to the
/// system allocator (smaller than [`THRESHOLD`], or aligned beyond a huge page).
pub fn region_len(layout: Layout) -> Option<usize> {
    if layout.size() < THRESHOLD || layout.align() > HUGE_PAGE {
        return None;
    }
    layout.size().checked_next_multiple_of(BASE_PAGE)
}

/// A value of [`ENV_SWITCH`]: `Some(true)` leaves huge pages on, `Some(false)` turns them off,
/// `None` is not a value the switch takes.
pub fn parse_switch(value: &[u8]) -> Option<bool> {
    // No allocation here (it runs inside the allocator): compare in place.
    let is = |words: &[&[u8]]| words.iter().any(|w| value.eq_ignore_ascii_case(w));
    if is(&[b"", b"1", b"on", b"true", b"yes"]) {
        Some(true)
    } else if is(&[b"0", b"off", b"false", b"no"]) {
        Some(false)
    } else {
        None
    }
}

/// Ends the process (exit code 2) for a value of [`ENV_SWITCH`] the switch does not take,
/// saying which; written with `write(2)` and left with `_exit`, since it runs inside an
/// allocation (no formatting, no allocation, no unwinding through the allocator).
fn refuse_switch(value: &[u8]) -> ! {
    let parts: [&[u8]; 3] = [
        b"error: RSRUN_HUGE_PAGES=",
        value,
        b" is not a huge-page switch (expected 0, off, false or no to turn huge pages off; 1, on, true or yes to keep them)\n",
    ];
    for part in parts {
        // SAFETY: writes `part`'s bytes to standard error; a failed write changes nothing.
        unsafe { libc::write(2, part.as_ptr().cast(), part.len()) };
    }
    // SAFETY: ends the process at once; nothing of ours needs running down.
    unsafe { libc::_exit(2) }
}

/// 0: not read yet, 1: on, 2: off.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Whether huge-page mappings are on for this process ([`ENV_SWITCH`], read once; threads that
/// race on the first read all read the same environment).
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            // getenv, not std::env::var: an allocator must not allocate.
            // SAFETY: getenv reads the environment for a NUL-terminated name; the returned
            // string (if any) is read before any other call could change it (no environment
            // writes happen inside an allocation).
            let value = unsafe {
                let v = libc::getenv(ENV_SWITCH_C.as_ptr());
                (!v.is_null()).then(|| std::ffi::CStr::from_ptr(v).to_bytes())
            };
            let on = match value {
                None => true,
                Some(v) => parse_switch(v).unwrap_or_else(|| refuse_switch(v)),
            };
            STATE.store(if on { 1 } else { 2 }, Ordering::Relaxed);
            on
        }
    }
}

/// [`region_len`] when the allocator is [`enabled`].
fn route(layout: Layout) -> Option<usize> {
    if enabled() { region_len(layout) } else { None }
}

/// Freed mappings by exact length: a pure structure over addresses (no system calls).
#[derive(Debug)]
pub struct Cache {
    slots: [(usize, usize); CACHE_SLOTS],
    bytes: usize,
}

impl Cache {
    /// An empty cache.
    pub const fn new() -> Self {
        Cache { slots: [(0, 0); CACHE_SLOTS], bytes: 0 }
    }

    /// Takes a cached mapping of exactly `len` bytes.
    pub fn take(&mut self, len: usize) -> Option<usize> {
        let slot = self.slots.iter_mut().find(|(addr, l)| *addr != 0 && *l == len)?;
        let addr = std::mem::take(slot).0;
        self.bytes -= len;
        Some(addr)
    }

    /// Keeps the mapping `(addr, len)` if there is a free slot and it fits the byte budget;
    /// otherwise hands it back, to be unmapped.
    pub fn put(&mut self, addr: usize, len: usize) -> Option<(usize, usize)> {
        if self.bytes + len > CACHE_BYTES {
            return Some((addr, len));
        }
        match self.slots.iter_mut().find(|(a, _)| *a == 0) {
            Some(slot) => {
                *slot = (addr, len);
                self.bytes += len;
                None
            }
            None => Some((addr, len)),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Default for Cache {
    fn default() -> Self {
        Self::new()
    }
}

static CACHE: Mutex<Cache> = Mutex::new(Cache::new());

fn cache() -> std::sync::MutexGuard<'static, Cache> {
    // The cache holds plain addresses and is consistent after every statement: a panic
    // elsewhere while it was locked leaves nothing half-done.
    CACHE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The global allocator: [`System`] below [`THRESHOLD`], 2 MiB-aligned `MADV_HUGEPAGE`
/// mappings above it.
///
/// ```ignore
/// #[global_allocator]
/// static ALLOC: rsrun_training_engine::hugepage::HugePageAlloc = rsrun_training_engine::hugepage::HugePageAlloc;
/// ```
#[derive(Debug, Default, Clone, Copy)]
pub struct HugePageAlloc;

/// A fresh mapping of `len` bytes (a multiple of [`BASE_PAGE`]) at a 2 MiB-aligned address,
/// advised for huge pages; its pages read as zero. Null when the kernel refuses.
fn map(len: usize) -> *mut u8 {
    let Some(span) = len.checked_add(HUGE_PAGE) else {
        return null_mut();
    };
    // SAFETY: an anonymous private mapping at an address the kernel picks; no memory of ours
    // is touched.
    let base = unsafe {
        libc::mmap(null_mut(), span, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if base == libc::MAP_FAILED {
        return null_mut();
    }
    let start = (base as usize).next_multiple_of(HUGE_PAGE);
    let head = start - base as usize;
    let tail = span - head - len;
    // SAFETY: the head and tail are the parts of `[base, base + span)` outside `[start,
    // start + len)`, both page-aligned (mmap returns page-aligned addresses, and `len` and
    // HUGE_PAGE are multiples of every base page size); nothing refers to them. The advice
    // only concerns our own fresh mapping (failure, e.g. on a kernel without THP, leaves
    // ordinary pages).
    unsafe {
        if head > 0 {
            libc::munmap(base, head);
        }
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
        libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    start as *mut u8
}

fn unmap(addr: usize, len: usize) {
    // SAFETY: `[addr, addr + len)` is a whole mapping made by `map` that its owner gave back.
    unsafe { libc::munmap(addr as *mut libc::c_void, len) };
}

/// A mapping of `len` bytes: a cached one (contents arbitrary, `fresh = false`) or a new one.
fn obtain(len: usize) -> (*mut u8, bool) {
    let cached = cache().take(len);
    match cached {
        Some(addr) => (addr as *mut u8, false),
        None => (map(len), true),
    }
}

fn release(ptr: *mut u8, len: usize) {
    let evicted = cache().put(ptr as usize, len);
    if let Some((addr, len)) = evicted {
        unmap(addr, len);
    }
}

// SAFETY: every block handed out is either System's (for layouts `route` sends there, which
// is decided by the layout and the once-read switch alone, so dealloc/realloc send it back to
// System) or a mapping of `region_len(layout)` bytes at a 2 MiB-aligned address (which
// satisfies any alignment up to HUGE_PAGE) owned by the caller until dealloc; a mapping is in
// the cache or handed out, never both.
unsafe impl GlobalAlloc for HugePageAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match route(layout) {
            // SAFETY: forwarded contract.
            None => unsafe { System.alloc(layout) },
            Some(len) => obtain(len).0,
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match route(layout) {
            // SAFETY: forwarded contract.
            None => unsafe { System.alloc_zeroed(layout) },
            Some(len) => {
                let (ptr, fresh) = obtain(len);
                if !fresh && !ptr.is_null() {
                    // SAFETY: a cached mapping of `len ≥ size` bytes, ours now.
                    unsafe { std::ptr::write_bytes(ptr, 0, layout.size()) };
                }
                ptr
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match route(layout) {
            // SAFETY: forwarded contract (System allocated it: same layout, same routing).
            None => unsafe { System.dealloc(ptr, layout) },
            Some(len) => release(ptr, len),
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY (constructing): the caller guarantees new_size, rounded up to the alignment,
        // does not overflow isize.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (route(layout), route(new_layout)) {
            // SAFETY: forwarded contract.
            (None, None) => unsafe { System.realloc(ptr, layout, new_size) },
            // The same mapping still fits and dealloc will compute the same length.
            (Some(old), Some(new)) if old == new => ptr,
            _ => {
                // SAFETY: a fresh block for the new layout, the old one's first
                // min(size, new_size) bytes copied, then the old one freed as allocated.
                unsafe {
                    let fresh = self.alloc(new_layout);
                    if !fresh.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, fresh, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                    fresh
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_or_overaligned_layouts_go_to_the_system_allocator() {
        let l = |size, align| Layout::from_size_align(size, align).unwrap();
        assert_eq!(region_len(l(THRESHOLD - 1, 64)), None);
        assert_eq!(region_len(l(THRESHOLD, 64)), Some(THRESHOLD));
        assert_eq!(region_len(l(THRESHOLD + 1, 4)), Some(THRESHOLD + BASE_PAGE));
        assert_eq!(region_len(l(3 * HUGE_PAGE, HUGE_PAGE)), Some(3 * HUGE_PAGE));
        assert_eq!(region_len(l(3 * HUGE_PAGE, 2 * HUGE_PAGE)), None);
    }

    #[test]
    fn the_switch_reads_the_usual_spellings_and_nothing_else() {
        for v in ["0", "off", "OFF", "false", "no"] {
            assert_eq!(parse_switch(v.as_bytes()), Some(false), "{v}");
        }
        for v in ["1", "on", "", "Yes", "true"] {
            assert_eq!(parse_switch(v.as_bytes()), Some(true), "{v}");
        }
        for v in ["2", "banana", " off", "offf"] {
            assert_eq!(parse_switch(v.as_bytes()), None, "{v}");
        }
    }

    #[test]
    fn cache_reuses_exact_lengths_within_its_budget() {
        let mut c = Cache::new();
        assert_eq!(c.take(HUGE_PAGE), None);
        assert_eq!(c.put(0x4000_0000, HUGE_PAGE), None);
        assert_eq!(c.put(0x8000_0000, 2 * HUGE_PAGE), None);
        assert_eq!(c.bytes(), 3 * HUGE_PAGE);
        assert_eq!(c.take(4 * HUGE_PAGE), None, "no length match");
        assert_eq!(c.take(2 * HUGE_PAGE), Some(0x8000_0000));
        assert_eq!(c.take(2 * HUGE_PAGE), None, "taken once");
        assert_eq!(c.bytes(), HUGE_PAGE);
        // Over the byte budget: handed back.
        assert_eq!(c.put(0xc000_0000, CACHE_BYTES), Some((0xc000_0000, CACHE_BYTES)));
        // Out of slots: handed back.
        let mut c = Cache::new();
        for i in 0..CACHE_SLOTS {
            assert_eq!(c.put((i + 1) << 30, HUGE_PAGE), None);
        }
        assert_eq!(c.put(0x7000_0000_0000, HUGE_PAGE), Some((0x7000_0000_0000, HUGE_PAGE)));
    }

    /// The kernel's THP mode, e.g. "madvise" (`[madvise]` is the selected one).
    fn thp_mode() -> Option<String> {
        let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
        let (_, rest) = s.split_once('[')?;
        Some(rest.split_once(']')?.0.to_string())
    }

    /// AnonHugePages (kB) of the mapping that contains `addr`, from /proc/self/smaps.
    fn anon_huge_kb(addr: usize) -> Option<usize> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((lo, hi)) = range.split_once('-')
                && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = lo <= addr && addr < hi;
                continue;
            }
            if inside && let Some(v) = line.strip_prefix("AnonHugePages:") {
                return v.trim().trim_end_matches("kB").trim().parse().ok();
            }
        }
        None
    }

    #[test]
    fn large_blocks_are_aligned_zeroed_reused_and_huge() {
        let a = HugePageAlloc;
        let layout = Layout::from_size_align(3 * HUGE_PAGE + 100, 64).unwrap();
        // SAFETY (all blocks): allocated here with `layout` (or the realloc'd size) and freed
        // once with the same layout.
        unsafe {
            let p = a.alloc_zeroed(layout);
            assert!(!p.is_null());
            assert_eq!(p as usize % HUGE_PAGE, 0);
            let s = std::slice::from_raw_parts_mut(p, layout.size());
            assert!(s.iter().all(|&b| b == 0));
            s.fill(0xab);
            if thp_mode().is_some_and(|m| m != "never") {
                // Touched: the kernel backed (at least some of) it with huge pages.
                let kb = anon_huge_kb(p as usize).expect("the mapping in smaps");
                assert!(kb >= 2048, "AnonHugePages {kb} kB for a touched 6 MiB advised mapping");
            }
            a.dealloc(p, layout);
            // The same length again comes from the cache, dirty, and alloc_zeroed clears it.
            let q = a.alloc_zeroed(layout);
            assert!(!q.is_null());
            assert!(std::slice::from_raw_parts(q, layout.size()).iter().all(|&b| b == 0));
            // realloc within the same mapping length keeps the pointer; across lengths and
            // down to the system allocator it keeps the contents.
            *q = 7;
            *q.add(HUGE_PAGE) = 9;
            let r = a.realloc(q, layout, 3 * HUGE_PAGE + 1000);
            assert_eq!(r, q);
            let big = Layout::from_size_align(3 * HUGE_PAGE + 1000, 64).unwrap();
            let r2 = a.realloc(r, big, 6 * HUGE_PAGE);
            assert!(!r2.is_null());
            assert_eq!((*r2, *r2.add(HUGE_PAGE)), (7, 9));
            let bigger = Layout::from_size_align(6 * HUGE_PAGE, 64).unwrap();
            let small = a.realloc(r2, bigger, 4096);
            assert_eq!(*small, 7);
            a.dealloc(small, Layout::from_size_align(4096, 64).unwrap());
        }
    }
}
