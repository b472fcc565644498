//! Idle-only mode: pause new work while other processes keep the CPU busy, resume when they
//! calm down. Running generations always finish; only new ones wait (the node refuses them
//! while paused).
//!
//! Every [`SAMPLE_EVERY`] the task reads the machine's CPU time (`/proc/stat`, all cores) and
//! this process's own (`/proc/self/stat`); other processes' share is the busy time that is
//! not ours over the total time of all cores. The [`Governor`] pauses as soon as one sample
//! is over the threshold and resumes only after [`CALM_SAMPLES`] samples in a row under
//! [`RESUME_FRACTION`] of it, so a load that hovers at the threshold does not flap. The
//! arithmetic is pure and tested on recorded samples; only [`spawn`] touches the system.

use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use crate::core::Node;

/// How often the load is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// Resume once other processes use less than this fraction of the threshold...
pub const RESUME_FRACTION: f32 = 0.75;
/// ...for this many samples in a row.
pub const CALM_SAMPLES: u32 = 3;

/// Cumulative CPU time of the whole machine, in clock ticks (the `cpu` line of `/proc/stat`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MachineTimes {
    /// All time of all cores.
    pub total: u64,
    /// Time not idle (and not waiting for I/O).
    pub busy: u64,
}

/// Parses the aggregate `cpu` line of `/proc/stat`.
///
/// Fields: user nice system idle iowait irq softirq steal guest guest_nice. `guest` and
/// `guest_nice` are already counted in `user` and `nice`, so they are left out of the total;
/// `idle` and `iowait` are the not-busy part.
pub fn parse_proc_stat(text: &str) -> Option<MachineTimes> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    if f.len() < 4 {
        return None;
    }
    let field = |i: usize| f.get(i).copied().unwrap_or(0);
    let total = (0..8).map(field).fold(0u64, u64::saturating_add);
    let idle = field(3).saturating_add(field(4));
    Some(MachineTimes {
        total,
        busy: total.saturating_sub(idle),
    })
}

/// This process's CPU time (user + system) in clock ticks, from `/proc/self/stat`.
///
/// The command name (field 2) may hold spaces and parentheses, so fields are counted after
/// the last `)`: utime and stime are fields 14 and 15 of the line, the 12th and 13th after it.
pub fn parse_self_stat(text: &str) -> Option<u64> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut f = rest.split_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some(utime.saturating_add(stime))
}

/// One reading of the machine and of this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// The machine's times.
    pub machine: MachineTimes,
    /// This process's CPU ticks.
    pub own: u64,
}

/// Other processes' CPU use between two samples, as a share of all cores (0 to 1); `None`
/// when no time passed (or the counters went backwards).
pub fn others_share(before: Sample, after: Sample) -> Option<f32> {
    let total = after.machine.total.checked_sub(before.machine.total)?;
    if total == 0 {
        return None;
    }
    let busy = after.machine.busy.saturating_sub(before.machine.busy);
    let own = after.own.saturating_sub(before.own);
    // Our ticks and the machine's are sampled a moment apart, so ours may exceed the busy
    // delta slightly: clamp instead of trusting the difference's sign.
    let others = busy.saturating_sub(own);
    Some((others as f64 / total as f64).clamp(0.0, 1.0) as f32)
}

/// Decides when to pause and resume.
#[derive(Clone, Copy, Debug)]
pub struct Governor {
    threshold: f32,
    paused: bool,
    calm: u32,
}

impl Governor {
    /// A governor that pauses above `threshold` (share of all cores used by others).
    pub fn new(threshold: f32) -> Governor {
        Governor {
            threshold,
            paused: false,
            calm: 0,
        }
    }

    /// Whether new work is paused now.
    pub fn paused(&self) -> bool {
        self.paused
    }

    /// Takes one measurement of other processes' share; returns the new state when it changes.
    pub fn observe(&mut self, share: f32) -> Option<bool> {
        if !self.paused {
            if share > self.threshold {
                self.paused = true;
                self.calm = 0;
                return Some(true);
            }
            return None;
        }
        if share < self.threshold * RESUME_FRACTION {
            self.calm += 1;
            if self.calm >= CALM_SAMPLES {
                self.paused = false;
                self.calm = 0;
                return Some(false);
            }
        } else {
            self.calm = 0;
        }
        None
    }
}

fn read_sample() -> Option<Sample> {
    let machine = parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)?;
    let own = parse_self_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
    Some(Sample { machine, own })
}

/// Starts watching the machine's load for `node` (idle-only mode). Without `/proc` (not
/// Linux) it warns once and never pauses.
pub fn spawn(node: Arc<Node>) {
    tokio::spawn(async move {
        let Some(mut last) = read_sample() else {
            warn!("idle-only: cannot read /proc/stat and /proc/self/stat here; never pausing");
            return;
        };
        let mut gov = Governor::new(node.cfg.idle_threshold);
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(now) = read_sample() else {
                continue;
            };
            let share = others_share(last, now);
            last = now;
            let Some(share) = share else {
                continue;
            };
            match gov.observe(share) {
                Some(true) => info!(
                    "idle-only: other processes use {:.0}% of the CPU (threshold {:.0}%): pausing new work",
                    share * 100.0,
                    gov.threshold * 100.0
                ),
                Some(false) => info!(
                    "idle-only: other processes use {:.0}% of the CPU: taking new work again",
                    share * 100.0
                ),
                None => continue,
            }
            node.set_paused(gov.paused());
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    // Recorded on a 4-core machine, two seconds apart: a compile job started in between.
    const STAT_0: &str = "cpu  1049530 1237 297464 27375842 15463 0 6171 0 0 0
cpu0 262103 322 74623 6843612 3843 0 2310 0 0 0
cpu1 262599 297 74349 6844370 3867 0 1289 0 0 0
cpu2 262381 311 74216 6844049 3875 0 1294 0 0 0
cpu3 262447 307 74276 6843811 3878 0 1278 0 0 0
intr 91163472 9 0 0 0 0 0 0 0 1 0 0 0 0 0 0 0
ctxt 187349233
btime 1718000000
processes 612093
procs_running 1
procs_blocked 0
softirq 36049832 3 8311561 7 1412215 0 0 12 14043154 0 12282880
";
    // 800 ticks passed (4 cores × 2 s × 100 Hz): 560 busy (user 480, system 80), 240 idle.
    const STAT_1: &str = "cpu  1050010 1237 297544 27376082 15463 0 6171 0 0 0
cpu0 262223 322 74643 6843672 3843 0 2310 0 0 0
";
    // Our own process: comm with spaces and a parenthesis; utime 1000, stime 200.
    const SELF_0: &str = "4242 (dcd (worker) x) S 1 4242 4242 0 -1 4194560 9312 0 0 0 1000 200 0 0 20 0 7 0 1234567 1234567890 12345 18446744073709551615 1 1 0 0 0 0 0 4096 17647 0 0 0 17 2 0 0 0 0 0";
    // Two seconds later we used 120 ticks (utime +100, stime +20).
    const SELF_1: &str = "4242 (dcd (worker) x) S 1 4242 4242 0 -1 4194560 9312 0 0 0 1100 220 0 0 20 0 7 0 1234567 1234567890 12345 18446744073709551615 1 1 0 0 0 0 0 4096 17647 0 0 0 17 2 0 0 0 0 0";

    #[test]
    fn parses_proc_stat() {
        let t = parse_proc_stat(STAT_0).unwrap();
        let total = 1049530 + 1237 + 297464 + 27375842 + 15463 + 6171;
        assert_eq!(t.total, total);
        assert_eq!(t.busy, total - 27375842 - 15463);
        assert_eq!(parse_proc_stat("intr 1 2 3\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 x 3 4\n"), None);
        // Old kernels have only four fields.
        assert_eq!(
            parse_proc_stat("cpu 10 0 10 80\n"),
            Some(MachineTimes {
                total: 100,
                busy: 20
            })
        );
    }

    #[test]
    fn guest_time_is_not_counted_twice() {
        let t = parse_proc_stat("cpu  100 0 0 100 0 0 0 0 50 50\n").unwrap();
        assert_eq!(
            t,
            MachineTimes {
                total: 200,
                busy: 100
            }
        );
    }

    #[test]
    fn parses_self_stat_with_an_awkward_command_name() {
        assert_eq!(parse_self_stat(SELF_0), Some(1200));
        assert_eq!(parse_self_stat(SELF_1), Some(1320));
        assert_eq!(parse_self_stat("4242 (dcd) S 1"), None);
    }

    #[test]
    fn others_share_leaves_out_our_own_time() {
        let a = Sample {
            machine: parse_proc_stat(STAT_0).unwrap(),
            own: parse_self_stat(SELF_0).unwrap(),
        };
        let b = Sample {
            machine: parse_proc_stat(STAT_1).unwrap(),
            own: parse_self_stat(SELF_1).unwrap(),
        };
        // 560 busy ticks of 800, 120 of them ours: others use 440 / 800.
        let share = others_share(a, b).unwrap();
        assert!((share - 0.55).abs() < 1e-6, "{share}");
        // Without subtracting ourselves it would be 0.7; a threshold of 0.6 tells them apart.
        let mut g = Governor::new(0.6);
        assert_eq!(g.observe(share), None);
        let mut g = Governor::new(0.5);
        assert_eq!(g.observe(share), Some(true));
        // No time passed, or the counters went backwards (a new boot): no reading.
        assert_eq!(others_share(b, b), None);
        assert_eq!(others_share(b, a), None);
    }

    #[test]
    fn we_alone_never_count_as_busy() {
        let a = Sample {
            machine: MachineTimes {
                total: 1000,
                busy: 100,
            },
            own: 50,
        };
        // We used every busy tick (and a little more, sampled a moment later).
        let b = Sample {
            machine: MachineTimes {
                total: 1800,
                busy: 900,
            },
            own: 860,
        };
        assert_eq!(others_share(a, b), Some(0.0));
    }

    #[test]
    fn the_governor_pauses_at_once_and_resumes_after_calm_samples() {
        let mut g = Governor::new(0.5);
        assert_eq!(g.observe(0.2), None);
        assert_eq!(g.observe(0.5), None, "at the threshold is not over it");
        assert_eq!(g.observe(0.51), Some(true));
        assert!(g.paused());
        // Under the threshold but not under 75% of it: still busy enough.
        for _ in 0..10 {
            assert_eq!(g.observe(0.4), None);
        }
        // Calm, calm, a spike resets the count, then three calm samples resume.
        assert_eq!(g.observe(0.1), None);
        assert_eq!(g.observe(0.1), None);
        assert_eq!(g.observe(0.45), None);
        assert_eq!(g.observe(0.1), None);
        assert_eq!(g.observe(0.1), None);
        assert_eq!(g.observe(0.1), Some(false));
        assert!(!g.paused());
        assert_eq!(g.observe(0.3), None);
    }

    #[test]
    fn a_recorded_busy_spell_pauses_then_resumes() {
        // Cumulative (total, busy, own) every two seconds on 2 cores (400 ticks a sample):
        // idle, a build using both cores for three samples, idle again.
        let rec: [(u64, u64, u64); 10] = [
            (0, 0, 0),
            (400, 40, 20),
            (800, 80, 40),
            (1200, 470, 60),
            (1600, 860, 80),
            (2000, 1250, 100),
            (2400, 1300, 120),
            (2800, 1350, 140),
            (3200, 1400, 160),
            (3600, 1450, 180),
        ];
        let samples: Vec<Sample> = rec
            .iter()
            .map(|&(total, busy, own)| Sample {
                machine: MachineTimes { total, busy },
                own,
            })
            .collect();
        let mut g = Governor::new(0.5);
        let states: Vec<bool> = samples
            .windows(2)
            .map(|w| {
                g.observe(others_share(w[0], w[1]).unwrap());
                g.paused()
            })
            .collect();
        assert_eq!(
            states,
            [false, false, true, true, true, true, true, false, false]
        );
    }
}
