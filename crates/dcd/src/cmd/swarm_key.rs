//! `dcd swarm-key new FILE`: writes a private swarm's pre-shared key (the file format of
//! libp2p's pnet, see `dc_net::swarm_key`).

use std::process::ExitCode;

use anyhow::Result;

use crate::cli::SwarmKeyNewArgs;

pub fn new(a: &SwarmKeyNewArgs) -> Result<ExitCode> {
    let key = dc_net::SwarmKey::write_new(&a.file)?;
    println!(
        "wrote a new swarm key to {} (fingerprint {}); give it to every member's \
         `dcd join --swarm-key FILE`, and keep it secret",
        a.file.display(),
        key.fingerprint()
    );
    Ok(ExitCode::SUCCESS)
}
