//! `dcd config show` and configuration errors through the real binary: flags over `DCD_*`
//! variables over the config file over defaults, the default config file location, and error
//! messages that name the key and where the bad value came from.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// `dcd` with a clean environment: no inherited `DCD_*` variables, and a config directory of
/// our own (`XDG_CONFIG_HOME`) so a developer's `~/.config/dcd/dcd.toml` cannot leak in.
fn dcd(config_home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dcd"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("DCD_") {
            c.env_remove(k);
        }
    }
    c.env("XDG_CONFIG_HOME", config_home);
    c
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "dcd failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn fails(out: Output) -> String {
    assert!(
        !out.status.success(),
        "dcd should have failed; stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stderr).expect("utf-8")
}

fn show(cmd: &mut Command) -> Value {
    let out = ok(cmd
        .args(["config", "show", "--json"])
        .output()
        .expect("runs"));
    serde_json::from_str(&out).expect("JSON")
}

fn setting<'a>(v: &'a Value, key: &str) -> (&'a Value, &'a str) {
    let s = &v["settings"][key];
    (&s["value"], s["source"].as_str().expect("a source"))
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p
}

#[test]
fn flags_beat_environment_beat_file_beat_defaults() {
    let home = tempfile::tempdir().unwrap();
    let file = write(
        home.path(),
        "dcd.toml",
        "threads = 3\nmax_memory = \"1GiB\"\nmax_generations = 4\nidle_only = true\n",
    );
    let v = show(
        dcd(home.path())
            .arg("--config")
            .arg(&file)
            .args(["--threads", "7"])
            .env("DCD_MAX_MEMORY", "2GiB")
            .env("DCD_THREADS", "5"),
    );
    assert_eq!(setting(&v, "threads"), (&Value::from(7), "flag --threads"));
    assert_eq!(
        setting(&v, "max_memory"),
        (&Value::from(2u64 << 30), "env DCD_MAX_MEMORY")
    );
    let from_file = format!("file {}", file.display());
    assert_eq!(
        setting(&v, "max_generations"),
        (&Value::from(4), from_file.as_str())
    );
    assert_eq!(
        setting(&v, "idle_only"),
        (&Value::from(true), from_file.as_str())
    );
    assert_eq!(setting(&v, "mdns"), (&Value::from(true), "default"));
    assert_eq!(v["config_file"], Value::from(file.display().to_string()));
}

#[test]
fn the_default_config_file_is_read_when_present_and_optional() {
    let home = tempfile::tempdir().unwrap();
    let v = show(&mut dcd(home.path()));
    assert_eq!(v["config_file"], Value::Null);
    assert_eq!(setting(&v, "max_generations").1, "default");

    std::fs::create_dir_all(home.path().join("dcd")).unwrap();
    let file = write(
        &home.path().join("dcd"),
        "dcd.toml",
        "max_generations = 2\n",
    );
    let v = show(&mut dcd(home.path()));
    assert_eq!(v["config_file"], Value::from(file.display().to_string()));
    assert_eq!(
        setting(&v, "max_generations"),
        (&Value::from(2), format!("file {}", file.display()).as_str())
    );
}

#[test]
fn the_shipped_config_file_changes_nothing() {
    let home = tempfile::tempdir().unwrap();
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/dcd.toml");
    let v = show(dcd(home.path()).arg("--config").arg(&shipped));
    let settings = v["settings"].as_object().unwrap();
    assert!(settings.len() >= 19, "{v}");
    for (key, s) in settings {
        assert!(
            s["source"].as_str().unwrap().starts_with("default"),
            "{key}: {s}"
        );
    }
}

#[test]
fn a_missing_config_file_given_with_the_flag_is_an_error() {
    let home = tempfile::tempdir().unwrap();
    let missing = home.path().join("nope.toml");
    let err = fails(
        dcd(home.path())
            .arg("--config")
            .arg(&missing)
            .args(["config", "show"])
            .output()
            .unwrap(),
    );
    assert!(
        err.contains(&format!("--config {}", missing.display())),
        "{err}"
    );
}

#[test]
fn unknown_keys_and_bad_values_name_the_key_and_the_source() {
    let home = tempfile::tempdir().unwrap();
    let file = write(home.path(), "bad.toml", "max_memroy = \"4GiB\"\n");
    let err = fails(
        dcd(home.path())
            .arg("--config")
            .arg(&file)
            .args(["config", "show"])
            .output()
            .unwrap(),
    );
    assert!(
        err.contains(&format!(
            "max_memroy (file {}): unknown setting",
            file.display()
        )),
        "{err}"
    );
    assert!(err.contains("did you mean `max_memory`?"), "{err}");

    let err = fails(
        dcd(home.path())
            .env("DCD_MAX_GENERATIONS", "many")
            .args(["config", "show"])
            .output()
            .unwrap(),
    );
    assert!(
        err.contains("max_generations (env DCD_MAX_GENERATIONS): \"many\" is not a whole number"),
        "{err}"
    );

    // Any command: the configuration resolves before it runs.
    let err = fails(
        dcd(home.path())
            .env("DCD_KERNEL", "gpu")
            .args(["selftest"])
            .output()
            .unwrap(),
    );
    assert!(err.contains("kernel (env DCD_KERNEL)"), "{err}");
}

#[test]
fn join_checks_its_settings_before_starting() {
    let home = tempfile::tempdir().unwrap();
    let err = fails(
        dcd(home.path())
            .args(["join", "--no-selftest"])
            .output()
            .unwrap(),
    );
    assert!(err.contains("no model to serve"), "{err}");
    assert!(err.contains("DCD_MODEL"), "{err}");

    let err = fails(
        dcd(home.path())
            .args(["join", "--model", "m", "--max-generations", "0"])
            .output()
            .unwrap(),
    );
    assert!(
        err.contains("max_generations (flag --max-generations): 0 is out of range"),
        "{err}"
    );

    let err = fails(
        dcd(home.path())
            .args(["join", "--model", "m", "--listen", "not-an-address"])
            .output()
            .unwrap(),
    );
    assert!(err.contains("listen (flag --listen)"), "{err}");
}

#[test]
fn join_flags_show_up_as_flags() {
    // `config show` resolves the global flags only; join's flags are checked by join itself
    // (above). The environment and file reach both alike.
    let home = tempfile::tempdir().unwrap();
    let v = show(
        dcd(home.path())
            .env(
                "DCD_LISTEN",
                "/ip4/127.0.0.1/tcp/1,/ip4/127.0.0.1/udp/1/quic-v1",
            )
            .env("DCD_LAYERS", "0..2")
            .env("DCD_MODEL", "smollm2-135m"),
    );
    assert_eq!(
        setting(&v, "listen"),
        (
            &serde_json::json!(["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/udp/1/quic-v1"]),
            "env DCD_LISTEN"
        )
    );
    assert_eq!(
        setting(&v, "layers"),
        (&Value::from("0..2"), "env DCD_LAYERS")
    );
    assert_eq!(
        setting(&v, "model"),
        (&Value::from("smollm2-135m"), "env DCD_MODEL")
    );
}

#[test]
fn the_token_is_never_printed() {
    let home = tempfile::tempdir().unwrap();
    let out = ok(dcd(home.path())
        .env("DCD_API_TOKEN", "sekrit-token")
        .args(["config", "show"])
        .output()
        .unwrap());
    assert!(!out.contains("sekrit-token"), "{out}");
    assert!(out.contains("api_token = \"(set, hidden)\""), "{out}");
    let out = ok(dcd(home.path())
        .env("DCD_API_TOKEN", "sekrit-token")
        .args(["config", "show", "--json"])
        .output()
        .unwrap());
    assert!(!out.contains("sekrit-token"), "{out}");
}

#[test]
fn unknown_environment_variables_are_warned_about() {
    let home = tempfile::tempdir().unwrap();
    let out = dcd(home.path())
        .env("DCD_MAX_MEMROY", "4GiB")
        .args(["config", "show"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("DCD_MAX_MEMROY is not a setting (did you mean DCD_MAX_MEMORY?)"),
        "{err}"
    );
}
