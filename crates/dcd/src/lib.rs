//! `dcd`'s command line as a library: the arguments (`cli`) and the settings resolved from
//! flags, environment and config file (`config`). The binary runs the commands; tests and the
//! fuzz targets reach the same parsers through here.

pub mod cli;
pub mod config;
