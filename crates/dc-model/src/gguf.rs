//! GGUF files (to be written).
