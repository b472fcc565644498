//! GPT-2's byte-level alphabet, written out independently of the tokenizer code under test.

/// GPT-2's byte → printable character map.
pub fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (u32::from(b'!')..=u32::from(b'~'))
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut map = vec!['\0'; 256];
    for (b, c) in bs.iter().zip(cs) {
        map[*b as usize] = char::from_u32(c).expect("test setup");
    }
    map
}
