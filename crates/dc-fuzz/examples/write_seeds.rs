//! Writes every target's seeds into `DIR/<target>/seed-N`, the fuzzers' starting corpora
//! (`scripts/fuzz.sh` runs it): `cargo run -p dc-fuzz --example write_seeds -- DIR`.

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: write_seeds DIR");
        std::process::exit(2);
    };
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for (name, data) in dc_fuzz::seeds::seeds() {
        let n = counts.entry(name).or_default();
        let target = dir.join(name);
        std::fs::create_dir_all(&target)?;
        std::fs::write(target.join(format!("seed-{n}")), data)?;
        *n += 1;
    }
    Ok(())
}
