//! The numeric core of DaisyChain: block quantisation, the exact integer product, deterministic
//! elementwise maths and commitments to exact accumulators. The contract is `docs/NUMERICS.md`.
//!
//! This crate is a leaf: no async runtime, no networking, no model formats. Everything in it
//! gives the same bits on every machine, kernel and thread count, and every optimised path has
//! a plain reference twin it is tested against.

#![deny(missing_docs)]

pub mod bench;
pub mod buffer;
pub mod conformance;
pub mod cpu;
pub mod elementwise;
pub mod error;
pub mod exact;
pub mod exp;
pub mod gemm;
pub mod golden;
pub mod int8;
pub mod pack;
pub mod quant;
pub mod rng;
pub mod verify;

pub use error::{KernelError, Result};
pub use exact::Exact;
pub use gemm::{Accumulators, Gemm, Kernel};
pub use pack::{PackedWeights, WeightLayout};
pub use quant::{BlockScale, QuantizedRows, BLOCK};
pub use verify::{Commitment, Domain};
