//! Keyed BLAKE3 of many short messages at once: the same 32 bytes as `blake3::keyed_hash` for
//! each message, with the chunks of all of them compressed eight at a time in AVX2 lanes.
//!
//! Why: a product's row leaf is a short message (a SmolLM2 row is 2.3 KB, two chunks and a
//! bit). Hashed one at a time, each chunk's sixteen compressions run one after another, and the
//! `blake3` crate's SIMD paths, which need several whole chunks of *one* message, never start:
//! committing cost a SmolLM2 stage 9–10 % of its decode, most of it in serial compressions.
//! Chunk compressions of different messages are independent, so a batch of rows (a prefill's
//! rows, or every row a decode hop commits) fills the lanes.
//!
//! The algorithm is BLAKE3 as its specification gives it (compression function, chunk chaining,
//! the tree's left subtree the largest power of two of chunks with at least one byte to its
//! right, keyed mode's flag and key on every compression). The lanes are property-tested
//! against the `blake3` crate on lengths around every block and chunk boundary; a batch too
//! small to fill them, or a machine without AVX2, is hashed by the crate itself.

use std::cmp::Reverse;

const IV: [u32; 8] = [
    0x6A09_E667,
    0xBB67_AE85,
    0x3C6E_F372,
    0xA54F_F53A,
    0x510E_527F,
    0x9B05_688C,
    0x1F83_D9AB,
    0x5BE0_CD19,
];

/// The message word each round reads at each place: round 0 in order, each next round the
/// previous one through BLAKE3's permutation.
const SCHEDULE: [[usize; 16]; 7] = {
    const PERMUTATION: [usize; 16] = [2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8];
    let mut s = [[0usize; 16]; 7];
    let mut i = 0;
    while i < 16 {
        s[0][i] = i;
        i += 1;
    }
    let mut r = 1;
    while r < 7 {
        let mut i = 0;
        while i < 16 {
            s[r][i] = s[r - 1][PERMUTATION[i]];
            i += 1;
        }
        r += 1;
    }
    s
};

const CHUNK_START: u32 = 1;
const CHUNK_END: u32 = 2;
const PARENT: u32 = 4;
const ROOT: u32 = 8;
const KEYED_HASH: u32 = 16;
const BLOCK_LEN: usize = 64;
const CHUNK_LEN: usize = 1024;
/// Chunks compressed side by side.
const LANES: usize = 8;

/// Messages to hash: each stored from a block boundary of one buffer and zero-padded to whole
/// blocks, so every block a lane reads is there.
#[derive(Clone, Debug, Default)]
pub struct Messages {
    bytes: Vec<u8>,
    spans: Vec<Span>,
}

/// One message: its first byte in the buffer, its length and its key.
#[derive(Clone, Copy, Debug)]
struct Span {
    start: usize,
    len: usize,
    key: [u8; 32],
}

impl Messages {
    /// Room for `messages` messages of about `each` bytes.
    pub fn with_capacity(messages: usize, each: usize) -> Messages {
        Messages {
            bytes: Vec::with_capacity(messages * each.next_multiple_of(BLOCK_LEN)),
            spans: Vec::with_capacity(messages),
        }
    }

    /// The number of messages.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Appends one message, `parts` concatenated, to be hashed under `key`.
    pub fn push(&mut self, key: &[u8; 32], parts: &[&[u8]]) {
        let start = self.bytes.len();
        for p in parts {
            self.bytes.extend_from_slice(p);
        }
        let len = self.bytes.len() - start;
        // An empty message still compresses one (empty) block.
        let padded = start + len.next_multiple_of(BLOCK_LEN).max(BLOCK_LEN);
        self.bytes.resize(padded, 0);
        self.spans.push(Span {
            start,
            len,
            key: *key,
        });
    }

    /// Empties the batch, keeping its buffers.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.spans.clear();
    }

    /// Each message's keyed BLAKE3 hash under its key, in order: in the lanes when the machine
    /// has AVX2 and the messages have enough chunks to fill them, otherwise one message at a
    /// time by the `blake3` crate.
    pub fn keyed_hashes(&self) -> Vec<[u8; 32]> {
        hash_spans(&self.bytes, &self.spans, Route::Auto)
    }

    /// [`Messages::keyed_hashes`] spread over the current rayon pool (the same hashes).
    pub fn keyed_hashes_par(&self) -> Vec<[u8; 32]> {
        use rayon::prelude::*;
        // Enough messages per task to fill the lanes several times over.
        let per_task = (self.spans.len() / (4 * rayon::current_num_threads()).max(1)).max(8);
        self.spans
            .par_chunks(per_task)
            .flat_map_iter(|spans| hash_spans(&self.bytes, spans, Route::Auto))
            .collect()
    }

    /// [`Messages::keyed_hashes`] always in the lanes (where the machine has AVX2), however few
    /// the chunks: what the tests compare with the `blake3` crate.
    pub fn keyed_hashes_in_lanes(&self) -> Vec<[u8; 32]> {
        hash_spans(&self.bytes, &self.spans, Route::Lanes)
    }
}

/// Fewest chunks worth the lanes: a group of eight lanes costs about three serial compressions
/// per block step and runs as many steps as its longest chunk has blocks, so a SmolLM2 row
/// alone (three chunks) hashes faster one compression after another, and two rows faster in
/// the lanes. A lone message of any length goes to the crate.
const MIN_LANE_CHUNKS: usize = 5;

/// Chunks from which a message goes to the crate even in a batch: from eight on the crate
/// compresses its chunks eight at a time itself, and faster than these lanes (measured: a
/// 4096-value row 11 µs by the crate, 15–17 µs in the lanes; a 1536-value row, seven chunks,
/// 6.2 µs against 5.2 µs).
const LONG_CHUNKS: usize = 8;

/// Whether a batch may go one message at a time when it is too small for the lanes.
#[derive(Clone, Copy, PartialEq)]
enum Route {
    Auto,
    Lanes,
}

/// Whether this machine runs the AVX2 lanes.
fn lanes_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn words(key: &[u8; 32]) -> [u32; 8] {
    std::array::from_fn(|i| u32::from_le_bytes(key[4 * i..4 * i + 4].try_into().expect("4 bytes")))
}

/// One run of chained compressions in a lane: a chunk (up to sixteen blocks) or a parent (one
/// block, the two child chaining values). Its first block carries `start` among its flags and
/// its last `end`, besides the keyed mode's flag on every block.
#[derive(Clone, Copy)]
struct Job {
    /// Its message's key (the chaining value its first block starts from).
    key: [u32; 8],
    /// Where its first block starts.
    at: usize,
    blocks: usize,
    last_len: u32,
    counter: u64,
    start: u32,
    end: u32,
}

/// A parent node of a message's tree: its children's places in the list of chaining values
/// (the chunks' first, then the parents'), its height above the chunks and whether it is the
/// root.
struct Parent {
    key: [u32; 8],
    left: usize,
    right: usize,
    height: usize,
    root: bool,
}

fn hash_spans(bytes: &[u8], spans: &[Span], route: Route) -> Vec<[u8; 32]> {
    let chunks = |s: &Span| s.len.div_ceil(CHUNK_LEN).max(1);
    let by_crate =
        |s: &Span| *blake3::keyed_hash(&s.key, &bytes[s.start..s.start + s.len]).as_bytes();
    if !lanes_available() {
        return spans.iter().map(by_crate).collect();
    }
    if route == Route::Lanes {
        return hash_in_lanes(bytes, spans);
    }
    // A long message fills the crate's own SIMD paths; the short ones share the lanes when
    // there are enough of them.
    let short: Vec<Span> = spans
        .iter()
        .filter(|s| chunks(s) < LONG_CHUNKS)
        .copied()
        .collect();
    let lanes = short.len() >= 2 && short.iter().map(chunks).sum::<usize>() >= MIN_LANE_CHUNKS;
    if !lanes {
        return spans.iter().map(by_crate).collect();
    }
    let mut from_lanes = hash_in_lanes(bytes, &short).into_iter();
    spans
        .iter()
        .map(|s| match chunks(s) < LONG_CHUNKS {
            true => from_lanes.next().expect("one hash per short message"),
            false => by_crate(s),
        })
        .collect()
}

/// [`hash_spans`] in the lanes (the machine has AVX2).
fn hash_in_lanes(bytes: &[u8], spans: &[Span]) -> Vec<[u8; 32]> {
    // Every chunk of every message, and where each message's chunks start in that list.
    let mut jobs = Vec::with_capacity(spans.len() * 3);
    let mut first = Vec::with_capacity(spans.len() + 1);
    for &Span { start, len, key } in spans {
        let key = words(&key);
        first.push(jobs.len());
        let n = len.div_ceil(CHUNK_LEN).max(1);
        for c in 0..n {
            let clen = (len - c * CHUNK_LEN).min(CHUNK_LEN);
            let blocks = clen.div_ceil(BLOCK_LEN).max(1);
            jobs.push(Job {
                key,
                at: start + c * CHUNK_LEN,
                blocks,
                last_len: (clen - (blocks - 1) * BLOCK_LEN) as u32,
                counter: c as u64,
                start: CHUNK_START,
                end: CHUNK_END | if n == 1 { ROOT } else { 0 },
            });
        }
    }
    first.push(jobs.len());
    let chunks = jobs.len();
    // Every message's parents, and the place of each message's root.
    let mut parents = Vec::new();
    let roots: Vec<usize> = first
        .windows(2)
        .zip(spans)
        .map(|(w, s)| tree(w[0]..w[1], chunks, &words(&s.key), true, &mut parents).0)
        .collect();
    let mut cvs = vec![[0u32; 8]; chunks + parents.len()];
    compress_jobs(bytes, &jobs, &mut cvs[..chunks]);
    // The parents a level at a time (each level's children are all done), side by side too.
    let top = parents.iter().map(|p| p.height).max().unwrap_or(0);
    let mut blocks = Vec::new();
    for height in 1..=top {
        let level: Vec<usize> = (0..parents.len())
            .filter(|&p| parents[p].height == height)
            .collect();
        blocks.clear();
        jobs.clear();
        for (i, &p) in level.iter().enumerate() {
            for w in cvs[parents[p].left].iter().chain(&cvs[parents[p].right]) {
                blocks.extend_from_slice(&w.to_le_bytes());
            }
            jobs.push(Job {
                key: parents[p].key,
                at: i * BLOCK_LEN,
                blocks: 1,
                last_len: BLOCK_LEN as u32,
                counter: 0,
                start: PARENT,
                end: if parents[p].root { ROOT } else { 0 },
            });
        }
        let mut out = vec![[0u32; 8]; level.len()];
        compress_jobs(&blocks, &jobs, &mut out);
        for (&p, cv) in level.iter().zip(out) {
            cvs[chunks + p] = cv;
        }
    }
    roots
        .iter()
        .map(|&r| {
            let mut out = [0u8; 32];
            for (o, w) in out.chunks_exact_mut(4).zip(cvs[r]) {
                o.copy_from_slice(&w.to_le_bytes());
            }
            out
        })
        .collect()
}

/// The tree over the chunks `chunks` (places in the list of chaining values), its parents
/// appended to `parents` (whose chaining values follow the `base` chunks' in that list):
/// the left subtree the largest power of two of chunks that leaves at least one to the
/// right, as BLAKE3 splits. Returns the place of its top and its height.
fn tree(
    chunks: std::ops::Range<usize>,
    base: usize,
    key: &[u32; 8],
    root: bool,
    parents: &mut Vec<Parent>,
) -> (usize, usize) {
    let n = chunks.len();
    if n == 1 {
        return (chunks.start, 0);
    }
    let k = 1 << (usize::BITS - 1 - (n - 1).leading_zeros());
    let (left, hl) = tree(chunks.start..chunks.start + k, base, key, false, parents);
    let (right, hr) = tree(chunks.start + k..chunks.end, base, key, false, parents);
    parents.push(Parent {
        key: *key,
        left,
        right,
        height: 1 + hl.max(hr),
        root,
    });
    (base + parents.len() - 1, 1 + hl.max(hr))
}

/// The chaining value of every job into `cvs`, in the lanes: the jobs longest first, so each
/// group of eight runs about as many blocks in every lane.
fn compress_jobs(bytes: &[u8], jobs: &[Job], cvs: &mut [[u32; 8]]) {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&j| Reverse(jobs[j].blocks));
    for group in order.chunks(LANES) {
        let lane_jobs: [Option<Job>; LANES] =
            std::array::from_fn(|l| group.get(l).map(|&j| jobs[j]));
        let mut out = [[0u32; 8]; LANES];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: only reached where AVX2 was detected (`hash_spans`); the kernel checks that
        // every block of every job lies in `bytes`.
        unsafe {
            avx2::jobs_x8(bytes, &lane_jobs, &mut out)
        };
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("lanes without AVX2: {bytes:p} {}", lane_jobs.len());
        for (&j, cv) in group.iter().zip(out) {
            cvs[j] = cv;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Eight jobs' compressions side by side: lane `l` of every vector belongs to job `l`.

    use super::{Job, BLOCK_LEN, IV, KEYED_HASH, LANES, SCHEDULE};
    use std::arch::x86_64::*;

    /// A block of zeros: what a lane without a job (or past its job's end) reads.
    static ZERO_BLOCK: [u8; BLOCK_LEN] = [0; BLOCK_LEN];

    /// The chaining value of each given job into `out` (a lane without a job is left alone).
    /// Panics unless `bytes` holds every block of every job whole.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn jobs_x8(
        bytes: &[u8],
        chunks: &[Option<Job>; LANES],
        out: &mut [[u32; 8]; LANES],
    ) {
        for c in chunks.iter().flatten() {
            assert!(
                c.at + c.blocks * BLOCK_LEN <= bytes.len(),
                "a job's blocks lie in the buffer"
            );
        }
        let blocks = chunks.iter().flatten().map(|c| c.blocks).max().unwrap_or(0);
        let per_lane = |f: &dyn Fn(&Job) -> u32| -> __m256i {
            let v: [u32; LANES] = std::array::from_fn(|l| chunks[l].as_ref().map_or(0, f));
            // SAFETY: an unaligned load of eight u32s from an array of eight.
            unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
        };
        // Each lane starts from its own message's key.
        let mut cv: [__m256i; 8] = std::array::from_fn(|i| per_lane(&|c| c.key[i]));
        let counter_lo = per_lane(&|c| c.counter as u32);
        let counter_hi = per_lane(&|c| (c.counter >> 32) as u32);
        // A lane without a job has no blocks, so it is never active.
        let lane_blocks = per_lane(&|c| c.blocks as u32);
        let last_len = per_lane(&|c| c.last_len);
        let start_flags = per_lane(&|c| c.start);
        let end_flags = per_lane(&|c| c.end);
        let keyed = _mm256_set1_epi32(KEYED_HASH as i32);
        let full = _mm256_set1_epi32(BLOCK_LEN as i32);
        let base: [*const u8; LANES] = std::array::from_fn(|l| match &chunks[l] {
            Some(c) => bytes[c.at..].as_ptr(),
            None => ZERO_BLOCK.as_ptr(),
        });
        let lane_count: [usize; LANES] = std::array::from_fn(|l| chunks[l].map_or(0, |c| c.blocks));
        for b in 0..blocks {
            let ptrs: [*const u8; LANES] = std::array::from_fn(|l| {
                if b < lane_count[l] {
                    // SAFETY: block `b` of this lane's job lies in `bytes` (checked above).
                    unsafe { base[l].add(b * BLOCK_LEN) }
                } else {
                    ZERO_BLOCK.as_ptr()
                }
            });
            let bv = _mm256_set1_epi32(b as i32);
            let active = _mm256_cmpgt_epi32(lane_blocks, bv);
            let last = _mm256_cmpeq_epi32(_mm256_sub_epi32(lane_blocks, _mm256_set1_epi32(1)), bv);
            let len = _mm256_blendv_epi8(full, last_len, last);
            let mut flags = _mm256_or_si256(keyed, _mm256_and_si256(last, end_flags));
            if b == 0 {
                flags = _mm256_or_si256(flags, start_flags);
            }
            // SAFETY: each pointer starts a whole block (checked above, or the zero block).
            let m = unsafe { load_transposed(&ptrs) };
            let mut s = [
                cv[0],
                cv[1],
                cv[2],
                cv[3],
                cv[4],
                cv[5],
                cv[6],
                cv[7],
                _mm256_set1_epi32(IV[0] as i32),
                _mm256_set1_epi32(IV[1] as i32),
                _mm256_set1_epi32(IV[2] as i32),
                _mm256_set1_epi32(IV[3] as i32),
                counter_lo,
                counter_hi,
                len,
                flags,
            ];
            // Written out (a macro, not a call), so every round's message indices are constants.
            macro_rules! round {
                ($r:expr) => {{
                    let r = &SCHEDULE[$r];
                    g(&mut s, 0, 4, 8, 12, m[r[0]], m[r[1]]);
                    g(&mut s, 1, 5, 9, 13, m[r[2]], m[r[3]]);
                    g(&mut s, 2, 6, 10, 14, m[r[4]], m[r[5]]);
                    g(&mut s, 3, 7, 11, 15, m[r[6]], m[r[7]]);
                    g(&mut s, 0, 5, 10, 15, m[r[8]], m[r[9]]);
                    g(&mut s, 1, 6, 11, 12, m[r[10]], m[r[11]]);
                    g(&mut s, 2, 7, 8, 13, m[r[12]], m[r[13]]);
                    g(&mut s, 3, 4, 9, 14, m[r[14]], m[r[15]]);
                }};
            }
            round!(0);
            round!(1);
            round!(2);
            round!(3);
            round!(4);
            round!(5);
            round!(6);
            for i in 0..8 {
                let next = _mm256_xor_si256(s[i], s[i + 8]);
                // A lane past its job's end keeps the chaining value it finished with.
                cv[i] = _mm256_blendv_epi8(cv[i], next, active);
            }
        }
        let words = transpose(cv);
        for (l, c) in chunks.iter().enumerate() {
            if c.is_some() {
                let mut w = [0u32; 8];
                // SAFETY: an unaligned store of eight u32s into an array of eight.
                unsafe { _mm256_storeu_si256(w.as_mut_ptr().cast(), words[l]) };
                out[l] = w;
            }
        }
    }

    /// The sixteen message words of each lane's block, word `i` of every lane in vector `i`.
    ///
    /// # Safety
    /// Each pointer must start 64 readable bytes.
    #[target_feature(enable = "avx2")]
    unsafe fn load_transposed(ptrs: &[*const u8; LANES]) -> [__m256i; 16] {
        // SAFETY: each pointer starts 64 readable bytes (the caller's promise).
        let lo: [__m256i; 8] =
            std::array::from_fn(|l| unsafe { _mm256_loadu_si256(ptrs[l].cast()) });
        let hi: [__m256i; 8] =
            std::array::from_fn(|l| unsafe { _mm256_loadu_si256(ptrs[l].add(32).cast()) });
        let (lo, hi) = (transpose(lo), transpose(hi));
        std::array::from_fn(|i| if i < 8 { lo[i] } else { hi[i - 8] })
    }

    /// The 8 × 8 transpose of 32-bit words: word `j` of vector `i` becomes word `i` of vector
    /// `j`.
    #[target_feature(enable = "avx2")]
    fn transpose(r: [__m256i; 8]) -> [__m256i; 8] {
        let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
        let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
        let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
        let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
        let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
        let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
        let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
        let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
        let u0 = _mm256_unpacklo_epi64(t0, t2);
        let u1 = _mm256_unpackhi_epi64(t0, t2);
        let u2 = _mm256_unpacklo_epi64(t1, t3);
        let u3 = _mm256_unpackhi_epi64(t1, t3);
        let u4 = _mm256_unpacklo_epi64(t4, t6);
        let u5 = _mm256_unpackhi_epi64(t4, t6);
        let u6 = _mm256_unpacklo_epi64(t5, t7);
        let u7 = _mm256_unpackhi_epi64(t5, t7);
        [
            _mm256_permute2x128_si256(u0, u4, 0x20),
            _mm256_permute2x128_si256(u1, u5, 0x20),
            _mm256_permute2x128_si256(u2, u6, 0x20),
            _mm256_permute2x128_si256(u3, u7, 0x20),
            _mm256_permute2x128_si256(u0, u4, 0x31),
            _mm256_permute2x128_si256(u1, u5, 0x31),
            _mm256_permute2x128_si256(u2, u6, 0x31),
            _mm256_permute2x128_si256(u3, u7, 0x31),
        ]
    }

    /// Rotates each 32-bit word right by whole bytes, as `mask` (per 128-bit half) moves them.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn rotate_bytes(x: __m256i, mask: [i8; 16]) -> __m256i {
        let [m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15] = mask;
        let m = _mm256_setr_epi8(
            m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15, m0, m1, m2, m3,
            m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15,
        );
        _mm256_shuffle_epi8(x, m)
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn rot16(x: __m256i) -> __m256i {
        rotate_bytes(x, [2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13])
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn rot8(x: __m256i) -> __m256i {
        rotate_bytes(x, [1, 2, 3, 0, 5, 6, 7, 4, 9, 10, 11, 8, 13, 14, 15, 12])
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn rot12(x: __m256i) -> __m256i {
        _mm256_or_si256(_mm256_srli_epi32(x, 12), _mm256_slli_epi32(x, 20))
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn rot7(x: __m256i) -> __m256i {
        _mm256_or_si256(_mm256_srli_epi32(x, 7), _mm256_slli_epi32(x, 25))
    }

    /// BLAKE3's quarter-round on eight lanes at once.
    #[target_feature(enable = "avx2")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn g(s: &mut [__m256i; 16], a: usize, b: usize, c: usize, d: usize, x: __m256i, y: __m256i) {
        s[a] = _mm256_add_epi32(_mm256_add_epi32(s[a], s[b]), x);
        s[d] = rot16(_mm256_xor_si256(s[d], s[a]));
        s[c] = _mm256_add_epi32(s[c], s[d]);
        s[b] = rot12(_mm256_xor_si256(s[b], s[c]));
        s[a] = _mm256_add_epi32(_mm256_add_epi32(s[a], s[b]), y);
        s[d] = rot8(_mm256_xor_si256(s[d], s[a]));
        s[c] = _mm256_add_epi32(s[c], s[d]);
        s[b] = rot7(_mm256_xor_si256(s[b], s[c]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn message(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Lengths at and around every block and chunk boundary up to the tree's third level.
    fn boundary_lengths() -> Vec<usize> {
        let mut v = vec![0, 1, 63, 64, 65, 127, 128, 129];
        for c in 1..=9 {
            for d in [-65i64, -64, -1, 0, 1, 64] {
                v.push((c * CHUNK_LEN as i64 + d) as usize);
            }
        }
        v
    }

    #[test]
    fn every_boundary_length_hashes_as_the_blake3_crate_does() {
        let key = *blake3::hash(b"a key").as_bytes();
        let mut m = Messages::default();
        let lens = boundary_lengths();
        for (i, &len) in lens.iter().enumerate() {
            m.push(&key, &[&message(len, i as u8)]);
        }
        let want: Vec<[u8; 32]> = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| *blake3::keyed_hash(&key, &message(len, i as u8)).as_bytes())
            .collect();
        assert_eq!(m.keyed_hashes_in_lanes(), want, "lanes");
        assert_eq!(m.keyed_hashes(), want, "lanes or not");
        assert_eq!(m.keyed_hashes_par(), want, "lanes on a pool");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any batch of messages, each made of parts (as a leaf's header and values are) and
        /// under one of two keys, hashes as the `blake3` crate hashes each message whole
        /// under its key: in the lanes, as routed by size, and on a pool.
        #[test]
        fn batches_hash_as_the_blake3_crate_does(
            keys in any::<[[u8; 32]; 2]>(),
            which in any::<u32>(),
            lens in proptest::collection::vec(0usize..12000, 0..24),
            split in 0usize..64,
            seed in any::<u8>(),
        ) {
            let mut m = Messages::with_capacity(lens.len(), 1000);
            let mut want = Vec::new();
            for (i, &len) in lens.iter().enumerate() {
                let msg = message(len, seed.wrapping_add(i as u8));
                let at = split.min(len);
                let key = &keys[(which >> (i % 32)) as usize & 1];
                m.push(key, &[&msg[..at], &msg[at..]]);
                want.push(*blake3::keyed_hash(key, &msg).as_bytes());
            }
            prop_assert_eq!(m.len(), lens.len());
            prop_assert_eq!(&m.keyed_hashes_in_lanes(), &want);
            prop_assert_eq!(&m.keyed_hashes(), &want);
            prop_assert_eq!(&m.keyed_hashes_par(), &want);
        }
    }
}
