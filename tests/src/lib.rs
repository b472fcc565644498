//! Helpers for the end-to-end tests: start real `dcd` daemons on loopback, read what they
//! print, query their control API, run the local reference, and stop them (gracefully or not).

#![allow(clippy::unwrap_used)] // test support: a panic is the failure report

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The `dcd` binary next to the test executable (cargo builds it for `cargo test --workspace`).
pub fn dcd() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let bin = dir.join("dcd");
    assert!(
        bin.is_file(),
        "{} not found: build it with cargo build (cargo test --workspace does)",
        bin.display()
    );
    bin
}

/// `../shared/fixtures`.
pub fn fixtures() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures");
    assert!(p.is_dir(), "shared fixtures not found at {}", p.display());
    p
}

/// A running `dcd join`.
#[derive(Debug)]
pub struct Daemon {
    /// The process.
    pub child: Child,
    /// Everything it printed on stdout so far.
    pub out: Arc<Mutex<Vec<String>>>,
    /// Its stderr log file.
    pub log: PathBuf,
    /// Its data directory.
    pub data: PathBuf,
    /// Control API base URL.
    pub api: String,
    /// Peer id.
    pub peer_id: String,
    /// A TCP listen address with /p2p/ suffix.
    pub addr: String,
}

fn wait_line(
    out: &Arc<Mutex<Vec<String>>>,
    prefix: &str,
    timeout: Duration,
    child: &mut Child,
    log: &Path,
) -> String {
    let start = Instant::now();
    loop {
        if let Some(l) = out.lock().unwrap().iter().find(|l| l.starts_with(prefix)) {
            return l.clone();
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "dcd exited ({status}) before printing {prefix:?}; stdout: {:?}; log: {}",
                out.lock().unwrap(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            start.elapsed() < timeout,
            "no {prefix:?} within {timeout:?}; stdout: {:?}",
            out.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Daemon {
    /// Starts `dcd join --model <model> <extra…>` on loopback with mDNS off and fast
    /// announcements, and waits until it serves.
    pub fn start(dir: &Path, name: &str, model: &Path, extra: &[&str]) -> Daemon {
        Self::start_with_env(dir, name, model, extra, &[])
    }

    /// [`Daemon::start`] with extra environment variables (e.g. `DCD_FAULT` for a liar).
    pub fn start_with_env(
        dir: &Path,
        name: &str,
        model: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let data = dir.join(name);
        std::fs::create_dir_all(&data).unwrap();
        let log = dir.join(format!("{name}.log"));
        let mut cmd = Command::new(dcd());
        cmd.args(["join", "--model"])
            .arg(model)
            .args([
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--no-mdns",
                "--api",
                "127.0.0.1:0",
                "--announce-secs",
                "0.3",
                "--rebalance-secs",
                "1.5",
                "--threads",
                "1",
            ])
            .arg("--data-dir")
            .arg(&data)
            .args(extra)
            .env("DCD_LOG", "info,libp2p=warn")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap());
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let out = Arc::new(Mutex::new(Vec::new()));
        let o2 = out.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                o2.lock().unwrap().push(line);
            }
        });
        let t = Duration::from_secs(60);
        let api = wait_line(&out, "control API on ", t, &mut child, &log)
            ["control API on ".len()..]
            .to_string();
        let peer_id =
            wait_line(&out, "peer id ", t, &mut child, &log)["peer id ".len()..].to_string();
        let addr = wait_line(
            &out,
            "listening on /ip4/127.0.0.1/tcp/",
            t,
            &mut child,
            &log,
        )["listening on ".len()..]
            .to_string();
        wait_line(&out, "serving layers ", t, &mut child, &log);
        Daemon {
            child,
            out,
            log,
            data,
            api,
            peer_id,
            addr,
        }
    }

    /// The status document.
    pub fn status(&self) -> Value {
        let mut r = ureq::get(&format!("{}/status", self.api)).call().unwrap();
        serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap()
    }

    /// Whether it sees `n` peers, all serving (a peer still loading is in no route).
    pub fn sees_serving(&self, n: usize) -> bool {
        let status = self.status();
        let peers = status["peers"].as_array().unwrap();
        peers.len() == n && peers.iter().all(|p| p["state"] == "serving")
    }

    /// The peers it has excluded on a proof.
    pub fn excluded(&self) -> Vec<String> {
        self.status()["excluded_peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["peer_id"].as_str().unwrap().to_string())
            .collect()
    }

    /// The layers it serves now.
    pub fn layers(&self) -> String {
        self.status()["layers"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGTERM and waits for a clean exit; returns what it printed.
    pub fn leave(mut self) -> Vec<String> {
        #[cfg(unix)]
        // SAFETY: signalling our own child process.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "dcd exited with {status} after SIGTERM; log: {}",
                    self.log_text()
                );
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "dcd did not exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(100));
        let out = self.out.lock().unwrap().clone();
        out
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs `dcd <args>` and returns stdout (panics with stderr on failure).
pub fn run_dcd(args: &[&str]) -> String {
    let out = Command::new(dcd()).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "dcd {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `dcd generate … --json` as parsed JSON.
pub fn generate_json(args: &[&str]) -> Value {
    let mut all = vec!["generate"];
    all.extend_from_slice(args);
    all.push("--json");
    serde_json::from_str(run_dcd(&all).trim()).unwrap()
}

/// A head over layers 0..2 (started with `head_extra`), an honest stage and a liar
/// (`--fault fault`) both serving 2..4, all serving and seeing each other. The liar announces a
/// huge throughput, so routes pick it.
pub fn swarm_with_liar(
    dir: &Path,
    model: &Path,
    head_extra: &[&str],
    fault: &str,
) -> (Daemon, Daemon, Daemon) {
    let mut head_args = vec!["--layers", "0..2"];
    head_args.extend_from_slice(head_extra);
    let head = Daemon::start(dir, "head", model, &head_args);
    let stage = |name: &str, extra: &[&str]| {
        let mut args = vec!["--layers", "2..4", "--no-head", "--bootstrap", &head.addr];
        args.extend_from_slice(extra);
        Daemon::start(dir, name, model, &args)
    };
    let honest = stage("honest", &[]);
    let liar = stage("liar", &["--fault", fault]);
    wait_until("everyone to see everyone", Duration::from_secs(30), || {
        head.sees_serving(2) && honest.sees_serving(2)
    });
    (head, honest, liar)
}

/// A bare network node on loopback speaking our protocol, in no swarm and with no key (an
/// intruder, or a stranger to a private swarm). Call inside a tokio runtime: its event loop is
/// spawned there.
pub fn bare_node(
    topic: &str,
) -> (
    dc_net::Client,
    tokio::sync::mpsc::Receiver<dc_net::NetEvent>,
) {
    let cfg = dc_net::NetConfig {
        listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
        ..dc_net::NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), topic.into())
    };
    let (client, events, ev_loop) = dc_net::start(cfg).unwrap();
    tokio::spawn(ev_loop.run());
    (client, events)
}
