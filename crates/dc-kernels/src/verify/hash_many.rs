//! Keyed BLAKE3 of many short messages at once: the same 32 bytes as `blake3::keyed_hash` for
//! each message, with the chunks of all of them compressed sixteen at a time in AVX-512 lanes
//! (eight in AVX2 where the machine has no AVX-512), each lane taking the next chunk the moment
//! it finishes one.
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
//!
//! Measured on a SmolLM2 decode layer's batch (31 KB: its products', cache and attention rows):
//! 5.6 µs in sixteen lanes, 10.6 µs in eight, 22 µs by the crate one message at a time; full
//! lanes run at 0.18 ns per byte (sixteen) and 0.34 (eight), where the crate reaches 0.13 only
//! on one message of 17 chunks or more.

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
/// Chunks compressed side by side in AVX2.
const LANES: usize = 8;
/// Chunks compressed side by side in AVX-512.
const WIDE_LANES: usize = 16;

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
        hash_spans(&self.bytes, &self.spans, Route::Lanes { wide: true })
    }

    /// [`Messages::keyed_hashes_in_lanes`] in the eight AVX2 lanes only, even where AVX-512
    /// could take sixteen: so a test covers both kernels on a machine with both.
    pub fn keyed_hashes_in_eight_lanes(&self) -> Vec<[u8; 32]> {
        hash_spans(&self.bytes, &self.spans, Route::Lanes { wide: false })
    }
}

/// Fewest chunks worth the lanes: a step of the lanes costs a few serial compressions, so a
/// SmolLM2 row alone (three chunks) hashes faster by the crate (2.0 µs against 2.4 µs in
/// sixteen lanes), and two rows faster in the lanes (2.6 µs against 4.0 µs). A lone message of
/// any length goes to the crate.
const MIN_LANE_CHUNKS: usize = 5;

/// Chunks from which a message goes to the crate even in a batch: from eight on the crate
/// compresses its chunks eight at a time itself, and faster than the AVX2 lanes (measured: a
/// 4096-value row 11 µs by the crate, 15–17 µs in the lanes; a 1536-value row, seven chunks,
/// 6.2 µs against 5.2 µs). Where AVX-512 gives sixteen lanes they beat the crate until its own
/// sixteen-way path starts, at seventeen chunks (four messages of 16 chunks 12.4 µs in the
/// lanes against 26 µs; of 17 chunks 13.1 µs against 9.0 µs).
const fn long_chunks(wide: bool) -> usize {
    match wide {
        true => 17,
        false => 8,
    }
}

/// Whether a batch may go one message at a time when it is too small for the lanes, and
/// whether the lanes may be AVX-512's sixteen.
#[derive(Clone, Copy, PartialEq)]
enum Route {
    Auto,
    Lanes { wide: bool },
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
    if let Route::Lanes { wide } = route {
        return hash_in_lanes(bytes, spans, wide && wide_lanes_available());
    }
    // A long message fills the crate's own SIMD paths; the short ones share the lanes when
    // there are enough of them.
    if !lanes_pay(spans.iter().map(|s| s.len)) {
        return spans.iter().map(by_crate).collect();
    }
    let wide = wide_lanes_available();
    let long = long_chunks(wide);
    let short: Vec<Span> = spans.iter().filter(|s| chunks(s) < long).copied().collect();
    let mut from_lanes = hash_in_lanes(bytes, &short, wide).into_iter();
    spans
        .iter()
        .map(|s| match chunks(s) < long {
            true => from_lanes.next().expect("one hash per short message"),
            false => by_crate(s),
        })
        .collect()
}

/// Whether messages of these lengths (bytes) are hashed faster together in the lanes than one
/// at a time by the `blake3` crate: the rule [`Messages::keyed_hashes`] follows (at least two
/// messages short of the crate's own SIMD paths, with [`MIN_LANE_CHUNKS`] chunks or more
/// between them, on a machine with AVX2). A caller holding a few messages can skip gathering
/// them when it does not pay.
pub fn lanes_pay(lens: impl IntoIterator<Item = usize>) -> bool {
    if !lanes_available() {
        return false;
    }
    let long = long_chunks(wide_lanes_available());
    let (mut short, mut chunks) = (0, 0);
    for len in lens {
        let c = len.div_ceil(CHUNK_LEN).max(1);
        if c < long {
            (short, chunks) = (short + 1, chunks + c);
        }
    }
    short >= 2 && chunks >= MIN_LANE_CHUNKS
}

/// The working lists of [`hash_in_lanes`], kept per thread so a decode step's many small
/// batches do not allocate them afresh.
#[derive(Default)]
struct Scratch {
    jobs: Vec<Job>,
    first: Vec<usize>,
    parents: Vec<Parent>,
    cvs: Vec<[u32; 8]>,
    level: Vec<usize>,
    blocks: Vec<u8>,
    out: Vec<[u32; 8]>,
    order: Vec<usize>,
}

/// [`hash_spans`] in the lanes (the machine has AVX2, and AVX-512F if `wide`).
fn hash_in_lanes(bytes: &[u8], spans: &[Span], wide: bool) -> Vec<[u8; 32]> {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Scratch> = Default::default();
    }
    SCRATCH.with_borrow_mut(|scratch| hash_in_lanes_with(bytes, spans, wide, scratch))
}

fn hash_in_lanes_with(bytes: &[u8], spans: &[Span], wide: bool, s: &mut Scratch) -> Vec<[u8; 32]> {
    let Scratch {
        jobs,
        first,
        parents,
        cvs,
        level,
        blocks,
        out,
        order,
    } = s;
    // Every chunk of every message, and where each message's chunks start in that list.
    jobs.clear();
    first.clear();
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
    // Every message's parents, and the place of each message's root (left in `first`).
    parents.clear();
    for (i, s) in spans.iter().enumerate() {
        first[i] = tree(
            first[i]..first[i + 1],
            chunks,
            &words(&s.key),
            true,
            parents,
        )
        .0;
    }
    cvs.clear();
    cvs.resize(chunks + parents.len(), [0; 8]);
    compress_jobs(bytes, jobs, &mut cvs[..chunks], wide, order);
    // The parents a level at a time (each level's children are all done), side by side too.
    let top = parents.iter().map(|p| p.height).max().unwrap_or(0);
    for height in 1..=top {
        level.clear();
        level.extend((0..parents.len()).filter(|&p| parents[p].height == height));
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
        out.clear();
        out.resize(level.len(), [0; 8]);
        compress_jobs(blocks, jobs, out, wide, order);
        for (&p, cv) in level.iter().zip(out.iter()) {
            cvs[chunks + p] = *cv;
        }
    }
    first[..spans.len()]
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

/// Whether this machine runs the sixteen-lane AVX-512 kernel too.
fn wide_lanes_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The chaining value of every job into `cvs`, in the lanes: sixteen if `wide` (the machine
/// has AVX-512F), otherwise eight. Each lane takes the next job as soon as its last one is
/// done, so lanes stay full however unequal the jobs; the jobs go longest first, so the last
/// steps, where lanes run out of jobs, are short ones.
fn compress_jobs(
    bytes: &[u8],
    jobs: &[Job],
    cvs: &mut [[u32; 8]],
    wide: bool,
    order: &mut Vec<usize>,
) {
    // Longest first by counting (a job is one to sixteen blocks): a decode step's few dozen
    // jobs are not worth a comparison sort.
    let mut next = [0usize; CHUNK_LEN / BLOCK_LEN + 1];
    for j in jobs {
        next[j.blocks] += 1;
    }
    let mut placed = 0;
    for n in next.iter_mut().rev() {
        (*n, placed) = (placed, placed + *n);
    }
    order.clear();
    order.resize(jobs.len(), 0);
    for (i, j) in jobs.iter().enumerate() {
        order[next[j.blocks]] = i;
        next[j.blocks] += 1;
    }
    #[cfg(target_arch = "x86_64")]
    match wide {
        // SAFETY (both): `wide` only where AVX-512F was detected, the eight lanes only where
        // AVX2 was (`hash_spans`).
        true => {
            run_lanes::<WIDE_LANES>(bytes, jobs, order, cvs, |l| unsafe { avx512::step_x16(l) })
        }
        false => run_lanes::<LANES>(bytes, jobs, order, cvs, |l| unsafe { avx2::step_x8(l) }),
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!(
        "lanes without AVX2: {bytes:p} {} {} {wide} {}",
        jobs.len(),
        cvs.len(),
        order.len()
    );
}

/// What `N` lanes compress in one step: one block each, from the chaining value, counter,
/// block length and flags of its lane (word `i` of every lane's chaining value in `cv[i]`).
/// A step leaves each lane's next chaining value in `cv`.
#[cfg(target_arch = "x86_64")]
struct Lanes<'a, const N: usize> {
    blocks: [&'a Block; N],
    cv: [[u32; N]; 8],
    counter_lo: [u32; N],
    counter_hi: [u32; N],
    len: [u32; N],
    flags: [u32; N],
}

/// One block of a message.
#[cfg(target_arch = "x86_64")]
type Block = [u8; BLOCK_LEN];

/// A block of zeros: what a lane without a job reads.
#[cfg(target_arch = "x86_64")]
static ZERO_BLOCK: Block = [0; BLOCK_LEN];

/// Runs `jobs` in the order `order` through `N` lanes, one block per lane per `step`, each
/// lane refilled from the queue when its job ends; each job's chaining value into `cvs`.
#[cfg(target_arch = "x86_64")]
fn run_lanes<const N: usize>(
    bytes: &[u8],
    jobs: &[Job],
    order: &[usize],
    cvs: &mut [[u32; 8]],
    step: impl Fn(&mut Lanes<'_, N>),
) {
    let mut lanes = Lanes {
        blocks: [&ZERO_BLOCK; N],
        cv: [[0; N]; 8],
        counter_lo: [0; N],
        counter_hi: [0; N],
        len: [0; N],
        flags: [0; N],
    };
    // Per lane: its job and the blocks it has still to compress, the next one first.
    let mut at: [Option<(usize, &[Block])>; N] = [None; N];
    let mut queue = order.iter();
    loop {
        for (l, lane) in at.iter_mut().enumerate() {
            if lane.is_some() {
                continue;
            }
            let Some(&j) = queue.next() else {
                lanes.blocks[l] = &ZERO_BLOCK;
                continue;
            };
            let job = &jobs[j];
            for (w, k) in lanes.cv.iter_mut().zip(job.key) {
                w[l] = k;
            }
            lanes.counter_lo[l] = job.counter as u32;
            lanes.counter_hi[l] = (job.counter >> 32) as u32;
            lanes.flags[l] = KEYED_HASH | job.start;
            let (blocks, _) =
                bytes[job.at..job.at + job.blocks * BLOCK_LEN].as_chunks::<BLOCK_LEN>();
            *lane = Some((j, blocks));
        }
        let Some(shortest) = at.iter().flatten().map(|(_, rest)| rest.len()).min() else {
            return;
        };
        // The steps before the first lane reaches its job's last block: full blocks only,
        // nothing to refill or flag, so each is just the next block of every lane (with full
        // chunks queued longest first, most of a batch's steps).
        lanes.len = [BLOCK_LEN as u32; N];
        for s in 0..shortest - 1 {
            for (l, lane) in at.iter().enumerate() {
                if let Some((_, rest)) = lane {
                    lanes.blocks[l] = &rest[s];
                }
            }
            step(&mut lanes);
            lanes.flags = [KEYED_HASH; N];
        }
        // The step in which the shortest jobs end.
        for (l, lane) in at.iter_mut().enumerate() {
            if let Some((j, rest)) = lane {
                *rest = &rest[shortest - 1..];
                lanes.blocks[l] = &rest[0];
                if rest.len() == 1 {
                    lanes.len[l] = jobs[*j].last_len;
                    lanes.flags[l] |= jobs[*j].end;
                }
            }
        }
        step(&mut lanes);
        for (l, lane) in at.iter_mut().enumerate() {
            if let Some((j, rest)) = *lane {
                lanes.flags[l] = KEYED_HASH;
                *lane = match rest.len() {
                    1 => {
                        cvs[j] = std::array::from_fn(|i| lanes.cv[i][l]);
                        None
                    }
                    _ => Some((j, &rest[1..])),
                };
            }
        }
    }
}

/// BLAKE3's seven rounds over a state of sixteen vectors with `g` as the quarter-round on
/// them; written out (a macro, not a loop), so every message index is a constant.
#[cfg(target_arch = "x86_64")]
macro_rules! rounds {
    ($g:ident, $s:ident, $m:ident) => {
        rounds!(@round $g, $s, $m, 0);
        rounds!(@round $g, $s, $m, 1);
        rounds!(@round $g, $s, $m, 2);
        rounds!(@round $g, $s, $m, 3);
        rounds!(@round $g, $s, $m, 4);
        rounds!(@round $g, $s, $m, 5);
        rounds!(@round $g, $s, $m, 6);
    };
    (@round $g:ident, $s:ident, $m:ident, $r:expr) => {{
        const R: [usize; 16] = SCHEDULE[$r];
        $g(&mut $s, 0, 4, 8, 12, $m[R[0]], $m[R[1]]);
        $g(&mut $s, 1, 5, 9, 13, $m[R[2]], $m[R[3]]);
        $g(&mut $s, 2, 6, 10, 14, $m[R[4]], $m[R[5]]);
        $g(&mut $s, 3, 7, 11, 15, $m[R[6]], $m[R[7]]);
        $g(&mut $s, 0, 5, 10, 15, $m[R[8]], $m[R[9]]);
        $g(&mut $s, 1, 6, 11, 12, $m[R[10]], $m[R[11]]);
        $g(&mut $s, 2, 7, 8, 13, $m[R[12]], $m[R[13]]);
        $g(&mut $s, 3, 4, 9, 14, $m[R[14]], $m[R[15]]);
    }};
}

/// One compression step's body, the same at every lane width: the state from the lanes'
/// chaining values, the IV and the lanes' counters, lengths and flags; the seven rounds with
/// `$g` over the message words `$m`; each lane's next chaining value stored back. `$load` and
/// `$store` move a lane array into and out of a vector, `$splat` broadcasts a word.
#[cfg(target_arch = "x86_64")]
macro_rules! compress_step {
    ($l:ident, $m:ident, $g:ident, $load:ident, $store:ident, $splat:path, $xor:path) => {{
        let mut s = [
            $load(&$l.cv[0]),
            $load(&$l.cv[1]),
            $load(&$l.cv[2]),
            $load(&$l.cv[3]),
            $load(&$l.cv[4]),
            $load(&$l.cv[5]),
            $load(&$l.cv[6]),
            $load(&$l.cv[7]),
            $splat(IV[0] as i32),
            $splat(IV[1] as i32),
            $splat(IV[2] as i32),
            $splat(IV[3] as i32),
            $load(&$l.counter_lo),
            $load(&$l.counter_hi),
            $load(&$l.len),
            $load(&$l.flags),
        ];
        rounds!($g, s, $m);
        for i in 0..8 {
            $store(&mut $l.cv[i], $xor(s[i], s[i + 8]));
        }
    }};
}

/// BLAKE3's quarter-round `g` on every lane at once, for vectors `$v` with the given add, xor
/// and rotations, compiled for `$feature`.
#[cfg(target_arch = "x86_64")]
macro_rules! quarter_round {
    ($feature:tt, $v:ty, $add:path, $xor:path, $r16:path, $r12:path, $r8:path, $r7:path) => {
        /// BLAKE3's quarter-round on every lane at once.
        #[target_feature(enable = $feature)]
        #[inline]
        #[allow(clippy::too_many_arguments)]
        fn g(s: &mut [$v; 16], a: usize, b: usize, c: usize, d: usize, x: $v, y: $v) {
            s[a] = $add($add(s[a], s[b]), x);
            s[d] = $r16($xor(s[d], s[a]));
            s[c] = $add(s[c], s[d]);
            s[b] = $r12($xor(s[b], s[c]));
            s[a] = $add($add(s[a], s[b]), y);
            s[d] = $r8($xor(s[d], s[a]));
            s[c] = $add(s[c], s[d]);
            s[b] = $r7($xor(s[b], s[c]));
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! Eight compressions side by side: lane `l` of every vector belongs to lane `l`'s block.

    use super::{Lanes, IV, LANES, SCHEDULE};
    use std::arch::x86_64::*;

    /// One compression step of eight lanes ([`Lanes`]).
    #[target_feature(enable = "avx2")]
    pub(super) fn step_x8(l: &mut Lanes<'_, LANES>) {
        // SAFETY (both): unaligned, of eight u32s from or into an array of eight.
        let load = |a: &[u32; LANES]| unsafe { _mm256_loadu_si256(a.as_ptr().cast()) };
        let store =
            |a: &mut [u32; LANES], v| unsafe { _mm256_storeu_si256(a.as_mut_ptr().cast(), v) };
        let m = load_transposed(&l.blocks);
        compress_step!(l, m, g, load, store, _mm256_set1_epi32, _mm256_xor_si256);
    }

    /// The sixteen message words of each lane's block, word `i` of every lane in vector `i`.
    #[target_feature(enable = "avx2")]
    fn load_transposed(blocks: &[&super::Block; LANES]) -> [__m256i; 16] {
        // SAFETY: unaligned loads of 32 bytes at offsets 0 and 32 of 64-byte arrays.
        let lo: [__m256i; 8] =
            std::array::from_fn(|l| unsafe { _mm256_loadu_si256(blocks[l].as_ptr().cast()) });
        let hi: [__m256i; 8] =
            std::array::from_fn(|l| unsafe { _mm256_loadu_si256(blocks[l][32..].as_ptr().cast()) });
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

    quarter_round!(
        "avx2",
        __m256i,
        _mm256_add_epi32,
        _mm256_xor_si256,
        rot16,
        rot12,
        rot8,
        rot7
    );
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! Sixteen compressions side by side: the AVX2 lanes' steps, with AVX-512's rotations.

    use super::{Lanes, IV, SCHEDULE, WIDE_LANES};
    use std::arch::x86_64::*;

    /// One compression step of sixteen lanes ([`Lanes`]).
    #[target_feature(enable = "avx512f")]
    pub(super) fn step_x16(l: &mut Lanes<'_, WIDE_LANES>) {
        // SAFETY (both): unaligned, of sixteen u32s from or into an array of sixteen.
        let load = |a: &[u32; WIDE_LANES]| unsafe { _mm512_loadu_si512(a.as_ptr().cast()) };
        let store =
            |a: &mut [u32; WIDE_LANES], v| unsafe { _mm512_storeu_si512(a.as_mut_ptr().cast(), v) };
        // SAFETY: unaligned loads of 64-byte arrays.
        let rows: [__m512i; 16] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_si512(l.blocks[i].as_ptr().cast()) });
        let m = transpose(rows);
        compress_step!(l, m, g, load, store, _mm512_set1_epi32, _mm512_xor_si512);
    }

    /// The 16 × 16 transpose of 32-bit words: word `j` of vector `i` becomes word `i` of
    /// vector `j`. Interleaving pairs of rows by words, then by word pairs, leaves in 128-bit
    /// lane `q` of `u[g][j]` word `4q + j` of rows `4g..4g + 4`; two rounds of 128-bit lane
    /// shuffles gather each word's four lanes.
    #[target_feature(enable = "avx512f")]
    fn transpose(r: [__m512i; 16]) -> [__m512i; 16] {
        let t: [__m512i; 16] = std::array::from_fn(|i| match i % 2 {
            0 => _mm512_unpacklo_epi32(r[i], r[i + 1]),
            _ => _mm512_unpackhi_epi32(r[i - 1], r[i]),
        });
        // u[g][j]: from rows 4g..4g+4, word 4q + j in lane q.
        let u: [[__m512i; 4]; 4] = std::array::from_fn(|g| {
            let (a, b) = (4 * g, 4 * g + 2);
            [
                _mm512_unpacklo_epi64(t[a], t[b]),
                _mm512_unpackhi_epi64(t[a], t[b]),
                _mm512_unpacklo_epi64(t[a + 1], t[b + 1]),
                _mm512_unpackhi_epi64(t[a + 1], t[b + 1]),
            ]
        });
        let mut out = [_mm512_setzero_si512(); 16];
        for j in 0..4 {
            // Lanes (0, 2) and (1, 3) of rows 0..8 and of rows 8..16.
            let v0 = _mm512_shuffle_i32x4::<0b10_00_10_00>(u[0][j], u[1][j]);
            let v1 = _mm512_shuffle_i32x4::<0b11_01_11_01>(u[0][j], u[1][j]);
            let v2 = _mm512_shuffle_i32x4::<0b10_00_10_00>(u[2][j], u[3][j]);
            let v3 = _mm512_shuffle_i32x4::<0b11_01_11_01>(u[2][j], u[3][j]);
            out[j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v0, v2);
            out[4 + j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v1, v3);
            out[8 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v0, v2);
            out[12 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v1, v3);
        }
        out
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn rot16(x: __m512i) -> __m512i {
        _mm512_ror_epi32::<16>(x)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn rot12(x: __m512i) -> __m512i {
        _mm512_ror_epi32::<12>(x)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn rot8(x: __m512i) -> __m512i {
        _mm512_ror_epi32::<8>(x)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn rot7(x: __m512i) -> __m512i {
        _mm512_ror_epi32::<7>(x)
    }

    quarter_round!(
        "avx512f",
        __m512i,
        _mm512_add_epi32,
        _mm512_xor_si512,
        rot16,
        rot12,
        rot8,
        rot7
    );
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
        assert_eq!(m.keyed_hashes_in_eight_lanes(), want, "eight lanes");
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
            prop_assert_eq!(&m.keyed_hashes_in_eight_lanes(), &want);
            prop_assert_eq!(&m.keyed_hashes(), &want);
            prop_assert_eq!(&m.keyed_hashes_par(), &want);
        }
    }
}
