//! CPU features that CPUID alone does not settle: AMX, whose tile registers a process may use
//! only after asking Linux for them (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`).
//! Some machines advertise AMX in CPUID while the OS refuses that permission (or never enabled
//! the tile state); a tile instruction there dies with SIGILL. So AMX counts as present only
//! when the request succeeds.
//!
//! No kernel uses AMX yet, and the reason is the block combination (NUMERICS.md §3), not the
//! detection: a tile product (`tdpbssd`, 16 rows × 16 columns × 64 bytes of k) spans two
//! 32-element blocks, so each block's sums would have to go through a tile of k = 32, be stored
//! to memory and be combined exactly in vector registers. That combination is already half the
//! AVX-512 kernel's instructions at prefill shapes (8 per row and block against 8 `vpdpbusd`),
//! so even products that cost nothing would buy at most 2×, before the store and reload of
//! every block's tile. An AMX kernel pays only with a combination that is cheaper per block.

/// Whether this process may run AMX int8 tile instructions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Amx {
    /// CPUID does not advertise AMX-TILE and AMX-INT8 (or the platform is not x86-64 Linux).
    Absent,
    /// CPUID advertises them, but the OS refused the tile data permission.
    Refused,
    /// The OS granted the tile data permission to this process.
    Granted,
}

impl Amx {
    /// Asks the OS (once per call; the grant, once given, lasts for the process).
    pub fn detect() -> Amx {
        if !advertised() {
            return Amx::Absent;
        }
        if request_tile_permission() {
            Amx::Granted
        } else {
            Amx::Refused
        }
    }

    /// A line for reports.
    pub fn describe(self) -> &'static str {
        match self {
            Amx::Absent => "not on this CPU",
            Amx::Refused => "advertised by CPUID, refused by the OS (no tile permission): not used",
            Amx::Granted => "granted by the OS; no AMX kernel yet (see dc-kernels cpu.rs)",
        }
    }
}

/// CPUID leaf 7, subleaf 0, EDX: bit 24 AMX-TILE, bit 25 AMX-INT8.
#[cfg(target_arch = "x86_64")]
fn advertised() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 7 is read only when leaf 0 reports it.
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn advertised() -> bool {
    false
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with this request only asks for a permission; it touches no memory
    // of ours, and a kernel that does not know it answers EINVAL.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tile_permission() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amx_is_granted_only_where_cpuid_advertises_it() {
        let amx = Amx::detect();
        if !advertised() {
            assert_eq!(amx, Amx::Absent);
        } else {
            assert_ne!(amx, Amx::Absent);
        }
        // A second request answers the same: the grant lasts for the process.
        assert_eq!(Amx::detect(), amx);
    }
}
