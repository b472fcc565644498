//! The pre-shared key of a private swarm: 32 bytes every member holds, in the key file format
//! of go-ipfs and the other libp2p implementations:
//!
//! ```text
//! /key/swarm/psk/1.0.0/
//! /base16/
//! <64 hex digits>
//! ```
//!
//! This module owns reading, writing and generating that file; the transport
//! ([`crate::transport`]) turns the key into libp2p's `pnet` handshake.

use std::io::Write;
use std::path::{Path, PathBuf};

use libp2p::pnet::PreSharedKey;
use rand::TryRng;
use thiserror::Error;

/// First line of a swarm key file.
pub const KEY_FILE_HEADER: &str = "/key/swarm/psk/1.0.0/";
/// Second line of a swarm key file: the only encoding we read and write.
pub const KEY_FILE_ENCODING: &str = "/base16/";
/// Bytes in a swarm key.
pub const SWARM_KEY_BYTES: usize = 32;
/// Largest key file read: a real one is 88 bytes; anything much larger is not a key.
const MAX_KEY_FILE_BYTES: u64 = 4096;

/// A private swarm's pre-shared key. Its `Debug` shows only the fingerprint, never the key.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SwarmKey([u8; SWARM_KEY_BYTES]);

impl std::fmt::Debug for SwarmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SwarmKey(fingerprint {})", self.fingerprint())
    }
}

/// What is wrong with a swarm key or its file.
#[derive(Debug, Error)]
pub enum SwarmKeyError {
    /// The file cannot be read or written.
    #[error("swarm key file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// `write_new` found a file already there.
    #[error("swarm key file {path} already exists; refusing to overwrite it")]
    Exists {
        /// The file.
        path: PathBuf,
    },
    /// The file is far too large to be a key file.
    #[error("swarm key file {path}: {len} bytes, a key file has about 88")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: u64,
    },
    /// The text is not a key in the expected format.
    #[error("swarm key file {path}: {problem}")]
    Malformed {
        /// The file (empty when parsing text that came from no file).
        path: PathBuf,
        /// What is wrong.
        problem: KeyFormatError,
    },
    /// The system's random source failed.
    #[error("no randomness for a new swarm key: {0}")]
    Random(String),
}

/// What is wrong with the text of a key file.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum KeyFormatError {
    /// The text is not UTF-8.
    #[error("not text (invalid UTF-8)")]
    NotText,
    /// The first line is not [`KEY_FILE_HEADER`].
    #[error("bad header {found:?}, expected {KEY_FILE_HEADER:?}")]
    BadHeader {
        /// The first line as found.
        found: String,
    },
    /// The second line is not [`KEY_FILE_ENCODING`].
    #[error("unsupported encoding {found:?}, expected {KEY_FILE_ENCODING:?}")]
    BadEncoding {
        /// The second line as found.
        found: String,
    },
    /// The key line is missing.
    #[error("no key line after the header and the encoding")]
    MissingKey,
    /// The key line has a character that is not a hex digit.
    #[error("bad hex: {found:?} at position {position} of the key line")]
    BadHex {
        /// The character.
        found: char,
        /// Its position (0-based, in characters).
        position: usize,
    },
    /// The key line does not have 64 hex digits.
    #[error("wrong length: {found} hex digits, a key has {}", SWARM_KEY_BYTES * 2)]
    WrongLength {
        /// Hex digits found.
        found: usize,
    },
    /// Something follows the key line.
    #[error("unexpected text after the key line: {found:?}")]
    TrailingText {
        /// The first extra line.
        found: String,
    },
}

/// Shows at most this many characters of a bad line in an error.
const SHOWN: usize = 64;

fn shown(s: &str) -> String {
    s.chars().take(SHOWN).collect()
}

impl SwarmKey {
    /// A key of these bytes.
    pub fn from_bytes(bytes: [u8; SWARM_KEY_BYTES]) -> Self {
        Self(bytes)
    }

    /// A new random key from the operating system's random source.
    pub fn generate() -> Result<Self, SwarmKeyError> {
        let mut bytes = [0u8; SWARM_KEY_BYTES];
        rand::rngs::SysRng
            .try_fill_bytes(&mut bytes)
            .map_err(|e| SwarmKeyError::Random(e.to_string()))?;
        Ok(Self(bytes))
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8; SWARM_KEY_BYTES] {
        &self.0
    }

    /// A fingerprint safe to log or show (the same as go-libp2p's), telling keys apart
    /// without revealing them.
    pub fn fingerprint(&self) -> String {
        PreSharedKey::new(self.0).fingerprint().to_string()
    }

    /// The key file's text.
    pub fn to_file_text(&self) -> String {
        let mut s = format!("{KEY_FILE_HEADER}\n{KEY_FILE_ENCODING}\n");
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s.push('\n');
        s
    }

    /// Parses a key file's text. Line ends may be `\n` or `\r\n`; the key's hex digits may be
    /// upper or lower case; blank lines after the key are allowed, nothing else is.
    pub fn parse(text: &str) -> Result<Self, KeyFormatError> {
        let mut lines = text.lines().map(|l| l.trim_end_matches('\r'));
        let header = lines.next().unwrap_or_default();
        if header.trim() != KEY_FILE_HEADER {
            return Err(KeyFormatError::BadHeader {
                found: shown(header),
            });
        }
        let encoding = lines.next().unwrap_or_default();
        if encoding.trim() != KEY_FILE_ENCODING {
            return Err(KeyFormatError::BadEncoding {
                found: shown(encoding),
            });
        }
        let key = lines.next().ok_or(KeyFormatError::MissingKey)?.trim();
        if key.is_empty() {
            return Err(KeyFormatError::MissingKey);
        }
        if let Some((position, found)) = key
            .chars()
            .enumerate()
            .find(|(_, c)| !c.is_ascii_hexdigit())
        {
            return Err(KeyFormatError::BadHex { found, position });
        }
        // Only ASCII hex digits remain, so bytes are characters.
        if key.len() != SWARM_KEY_BYTES * 2 {
            return Err(KeyFormatError::WrongLength { found: key.len() });
        }
        if let Some(extra) = lines.find(|l| !l.trim().is_empty()) {
            return Err(KeyFormatError::TrailingText {
                found: shown(extra),
            });
        }
        let mut bytes = [0u8; SWARM_KEY_BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            let pair = &key[2 * i..2 * i + 2];
            *b = u8::from_str_radix(pair, 16).map_err(|_| KeyFormatError::BadHex {
                found: pair.chars().next().unwrap_or('?'),
                position: 2 * i,
            })?;
        }
        Ok(Self(bytes))
    }

    /// Reads the key file at `path`.
    pub fn read(path: &Path) -> Result<Self, SwarmKeyError> {
        let io = |source| SwarmKeyError::Io {
            path: path.to_path_buf(),
            source,
        };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_KEY_FILE_BYTES {
            return Err(SwarmKeyError::TooLarge {
                path: path.to_path_buf(),
                len,
            });
        }
        let bytes = std::fs::read(path).map_err(io)?;
        let malformed = |problem| SwarmKeyError::Malformed {
            path: path.to_path_buf(),
            problem,
        };
        let text = std::str::from_utf8(&bytes).map_err(|_| malformed(KeyFormatError::NotText))?;
        Self::parse(text).map_err(malformed)
    }

    /// Generates a new key and writes it to `path` (mode 0600 on unix), creating the parent
    /// directory if needed. Refuses to overwrite an existing file.
    pub fn write_new(path: &Path) -> Result<Self, SwarmKeyError> {
        let key = Self::generate()?;
        key.write(path)?;
        Ok(key)
    }

    /// Writes this key to a new file at `path` (mode 0600 on unix). Refuses to overwrite an
    /// existing file.
    pub fn write(&self, path: &Path) -> Result<(), SwarmKeyError> {
        let io = |source| SwarmKeyError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| SwarmKeyError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let mut f = match opts.open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(SwarmKeyError::Exists {
                    path: path.to_path_buf(),
                })
            }
            Err(e) => return Err(io(e)),
        };
        f.write_all(self.to_file_text().as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(io)
    }

    pub(crate) fn to_psk(self) -> PreSharedKey {
        PreSharedKey::new(self.0)
    }
}

impl std::str::FromStr for SwarmKey {
    type Err = KeyFormatError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";

    #[test]
    fn the_text_round_trips_and_matches_the_pnet_format() {
        let k = SwarmKey::generate().unwrap();
        assert_eq!(SwarmKey::parse(&k.to_file_text()).unwrap(), k);
        // The same text libp2p's own pnet writes, so other implementations read our files.
        assert_eq!(k.to_file_text(), k.to_psk().to_key_file());
        let text = format!("{KEY_FILE_HEADER}\r\n{KEY_FILE_ENCODING}\r\n{HEX}\r\n\r\n");
        let k = SwarmKey::parse(&text).unwrap();
        assert_eq!(k.as_bytes()[1], 0x11);
        assert_eq!(k.as_bytes()[31], 0xff);
        assert!(!format!("{k:?}").contains("0011"));
    }

    #[test]
    fn malformed_texts_say_what_is_wrong() {
        let ok = |key: &str| format!("{KEY_FILE_HEADER}\n{KEY_FILE_ENCODING}\n{key}\n");
        assert!(matches!(
            SwarmKey::parse(&format!("/key/swarm/psk/2.0.0/\n{KEY_FILE_ENCODING}\n{HEX}\n")),
            Err(KeyFormatError::BadHeader { found }) if found == "/key/swarm/psk/2.0.0/"
        ));
        assert!(matches!(
            SwarmKey::parse(&format!("{KEY_FILE_HEADER}\n/base64/\n{HEX}\n")),
            Err(KeyFormatError::BadEncoding { found }) if found == "/base64/"
        ));
        assert_eq!(
            SwarmKey::parse(&format!("{KEY_FILE_HEADER}\n{KEY_FILE_ENCODING}\n")),
            Err(KeyFormatError::MissingKey)
        );
        assert_eq!(
            SwarmKey::parse(&ok(&HEX[..62])),
            Err(KeyFormatError::WrongLength { found: 62 })
        );
        assert_eq!(
            SwarmKey::parse(&ok(&format!("{HEX}00"))),
            Err(KeyFormatError::WrongLength { found: 66 })
        );
        let bad = format!("{}g{}", &HEX[..10], &HEX[11..]);
        assert_eq!(
            SwarmKey::parse(&ok(&bad)),
            Err(KeyFormatError::BadHex {
                found: 'g',
                position: 10
            })
        );
        // A multi-byte character where a digit belongs is an error, never a panic.
        let bad = format!("{}é{}", &HEX[..3], &HEX[5..]);
        assert!(matches!(
            SwarmKey::parse(&ok(&bad)),
            Err(KeyFormatError::BadHex { found: 'é', .. })
        ));
        assert!(matches!(
            SwarmKey::parse(&format!("{}extra\n", ok(HEX))),
            Err(KeyFormatError::TrailingText { found }) if found == "extra"
        ));
        assert!(matches!(
            SwarmKey::parse(""),
            Err(KeyFormatError::BadHeader { .. })
        ));
    }
}
