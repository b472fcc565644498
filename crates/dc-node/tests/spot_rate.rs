//! The head's spot-check coins at the default rate (`SpotRate::Goal`): each stage's parts are
//! drawn at the goal's rate for that stage's layer count, so a small stage is checked more
//! often per part than a large one, and each stage gets about the same number of parts per hop.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::PathBuf;

use dc_model::{LoadOptions, Model};
use dc_node::check::spot::picks;
use dc_node::SpotRate;
use dc_types::{GenerationId, LayerRange};

fn config(name: &str) -> dc_model::ModelConfig {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures");
    Model::load(&dir.join(name), &LoadOptions::default())
        .unwrap()
        .config
}

/// Parts drawn per layer and hop by the head's coins over `hops` decode hops of `layers`.
fn drawn_share(cfg: &dc_model::ModelConfig, layers: LayerRange, rate: f32, hops: u64) -> f64 {
    let parts = dc_model::check_parts(cfg);
    let g = GenerationId([9; 16]);
    let drawn: usize = (0..hops)
        .flat_map(|step| picks(&[7; 32], &g, step, layers, 40, 1, &parts, rate))
        .map(|p| p.checks.len())
        .sum();
    drawn as f64 / (hops as usize * layers.len() as usize * parts.len()) as f64
}

#[test]
fn each_stage_is_drawn_at_its_own_goal_rate() {
    for name in ["llama", "gpt2"] {
        let cfg = config(name);
        for layers in [1u32, 2, 4] {
            let range = LayerRange::new(0, layers).unwrap();
            let rate = SpotRate::Goal.for_stage(&cfg, layers as usize);
            assert_eq!(rate, dc_model::goal_rate(&cfg, layers as usize) as f32);
            let hops = 4000;
            let share = drawn_share(&cfg, range, rate, hops);
            let draws =
                (hops as usize * layers as usize * dc_model::check_parts(&cfg).len()) as f64;
            let sd = (rate as f64 * (1.0 - rate as f64) / draws).sqrt();
            assert!(
                (share - rate as f64).abs() < 5.0 * sd,
                "{name}, {layers} layers: drawn {share}, rate {rate}"
            );
        }
        // Smaller stages are drawn more often per part; a fixed rate is every stage's.
        let (one, four) = (
            SpotRate::Goal.for_stage(&cfg, 1),
            SpotRate::Goal.for_stage(&cfg, 4),
        );
        assert!(one > 3.0 * four, "{name}: {one} and {four}");
        assert_eq!(SpotRate::Fixed(0.06).for_stage(&cfg, 1), 0.06);
        assert_eq!(SpotRate::Fixed(0.06).for_stage(&cfg, 4), 0.06);
    }
}

#[test]
fn the_rate_reads_and_prints_as_the_config_file_takes_it() {
    assert_eq!("auto".parse::<SpotRate>(), Ok(SpotRate::Goal));
    assert_eq!(" Auto ".parse::<SpotRate>(), Ok(SpotRate::Goal));
    assert_eq!("0.25".parse::<SpotRate>(), Ok(SpotRate::Fixed(0.25)));
    assert_eq!("0".parse::<SpotRate>(), Ok(SpotRate::Fixed(0.0)));
    for bad in ["", "often", "1.5", "-0.1", "NaN"] {
        let e = bad.parse::<SpotRate>().unwrap_err();
        assert!(
            e.contains("neither \"auto\" nor a number from 0 to 1"),
            "{bad}: {e}"
        );
    }
    for r in [SpotRate::Goal, SpotRate::Fixed(0.06), SpotRate::Fixed(1.0)] {
        assert_eq!(r.to_string().parse::<SpotRate>(), Ok(r));
    }
}
