//! Aligned, zeroed byte buffers for packed weights, backed by transparent huge pages when large.
//!
//! Decode streams every weight once per token, so it is bound by memory bandwidth; on the
//! machines we measured, 2 MiB pages read 1.25–1.5× faster than 4 KiB pages. Large buffers are
//! therefore aligned to 2 MiB and marked `MADV_HUGEPAGE` (a hint: the kernel may decline).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// Alignment of small buffers: a cache line, enough for any SIMD load.
const SMALL_ALIGN: usize = 64;
/// Size of a transparent huge page on x86-64 and aarch64 Linux.
pub const HUGE_PAGE: usize = 2 << 20;

/// A zero-initialised, aligned, fixed-size byte buffer.
pub struct AlignedBytes {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

/// Where the bytes came from, so they go back the same way.
enum Backing {
    /// The global allocator.
    Heap(Layout),
    /// An anonymous mapping of this many bytes (huge-page candidates).
    #[cfg(target_os = "linux")]
    Mapped(usize),
}

// SAFETY: AlignedBytes owns its allocation exclusively, like a Box<[u8]>.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access only hands out shared slices.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    /// A zeroed buffer of `len` bytes (huge-page backed when at least one huge page long).
    pub fn zeroed(len: usize) -> AlignedBytes {
        #[cfg(target_os = "linux")]
        if len >= HUGE_PAGE {
            if let Some(b) = Self::mapped(len) {
                return b;
            }
        }
        let layout = Layout::from_size_align(len.max(1), SMALL_ALIGN).expect("buffer layout");
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout);
        };
        AlignedBytes {
            ptr,
            len,
            backing: Backing::Heap(layout),
        }
    }

    /// A fresh anonymous mapping, 2 MiB aligned and marked for huge pages before any page is
    /// touched (pages faulted in before `madvise` would stay 4 KiB). Fresh mappings read as
    /// zero, so nothing needs clearing.
    #[cfg(target_os = "linux")]
    fn mapped(len: usize) -> Option<AlignedBytes> {
        let size = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let span = size + HUGE_PAGE;
        // SAFETY: an anonymous private mapping with no address hint; checked below.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE_PAGE);
        // SAFETY: both trimmed ranges lie inside the mapping we just made and are unused.
        unsafe {
            if aligned > start {
                libc::munmap(raw, aligned - start);
            }
            let tail = start + span - (aligned + size);
            if tail > 0 {
                libc::munmap((aligned + size) as *mut libc::c_void, tail);
            }
            libc::madvise(aligned as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
        }
        Some(AlignedBytes {
            ptr: NonNull::new(aligned as *mut u8)?,
            len,
            backing: Backing::Mapped(size),
        })
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> AlignedBytes {
        let mut b = AlignedBytes::zeroed(bytes.len());
        b.as_mut_slice().copy_from_slice(bytes);
        b
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: allocated with exactly this layout in `zeroed`.
            Backing::Heap(layout) => unsafe { dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: exactly the range `mapped` kept.
            #[cfg(target_os = "linux")]
            Backing::Mapped(size) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), size);
            },
        }
    }
}

impl Clone for AlignedBytes {
    fn clone(&self) -> Self {
        AlignedBytes::from_slice(self.as_slice())
    }
}

impl std::fmt::Debug for AlignedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBytes({} bytes)", self.len)
    }
}
