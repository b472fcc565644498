//! Answering peers that fetch: the manifest, and bytes of the pieces this daemon holds, each
//! answer at most [`MAX_PIECE_CHUNK`] bytes and inside the message cap, with a bounded number
//! of reads at once.

use std::io::{Read, Seek, SeekFrom};

use dc_types::{ModelId, PieceRequest, MAX_PIECE_CHUNK};

use super::Weights;

/// Room left in an answer for its framing.
const FRAMING: usize = 1024;

impl Weights {
    /// The encoded manifest, if `model_id` is ours.
    pub fn serve_manifest(&self, model_id: &ModelId) -> Result<Vec<u8>, String> {
        if *model_id != self.node.model_id {
            return Err(format!("this peer serves model {}", self.node.model_id));
        }
        Ok(self.manifest_bytes.clone())
    }

    /// The bytes `r` asks for, if this daemon holds the piece.
    pub async fn serve_piece(&self, r: PieceRequest) -> Result<Vec<u8>, String> {
        if r.model_id != self.node.model_id {
            return Err(format!("this peer serves model {}", self.node.model_id));
        }
        let cap =
            (self.node.cfg.max_message_bytes.saturating_sub(FRAMING)).min(MAX_PIECE_CHUNK as usize);
        if r.len as usize > cap {
            return Err(format!(
                "{} bytes asked for; this peer sends at most {cap} at once",
                r.len
            ));
        }
        let Some(piece) = self.manifest.pieces.get(r.piece as usize) else {
            return Err(format!(
                "piece {}: the manifest has {}",
                r.piece,
                self.manifest.pieces.len()
            ));
        };
        let end = r.offset.checked_add(u64::from(r.len));
        if r.len == 0 || end.is_none_or(|e| e > piece.len) {
            return Err(format!(
                "bytes {}..+{} are outside piece {} ({} bytes)",
                r.offset, r.len, r.piece, piece.len
            ));
        }
        if !self.holds(r.piece) {
            return Err(format!("this peer does not hold piece {}", r.piece));
        }
        let path = self
            .manifest
            .file_path(&self.model_path, piece.file)
            .ok_or("the manifest names no such file")?;
        let _permit = self
            .reads
            .acquire()
            .await
            .map_err(|_| "shutting down".to_string())?;
        let at = piece.offset + r.offset;
        let len = r.len as usize;
        #[allow(unused_mut)]
        let mut bytes = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u8>> {
            let mut f = std::fs::File::open(&path)?;
            f.seek(SeekFrom::Start(at))?;
            let mut buf = vec![0u8; len];
            f.read_exact(&mut buf)?;
            Ok(buf)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("reading piece {}: {e}", r.piece))?;
        #[cfg(feature = "fault-injection")]
        if crate::stage::fault::corrupts_pieces() {
            if let Some(b) = bytes.get_mut(len / 2) {
                *b ^= 0x40;
                tracing::info!("fault: corrupting bytes of piece {}", r.piece);
            }
        }
        Ok(bytes)
    }
}
