//! Tokenizers (to be written).
