//! Activations on the wire: the one place they are converted to and from the wire form, with
//! every check a peer's activations must pass before any layer runs on them (width, whole
//! rows, positions within the model, finite values).

use dc_model::Activations;
use dc_types::WireActivations;

/// Converts wire activations, checking their shape.
pub fn from_wire(
    w: WireActivations,
    hidden: usize,
    max_positions: usize,
) -> Result<Activations, String> {
    if w.hidden as usize != hidden {
        return Err(format!(
            "activations are {} wide, the model is {hidden}",
            w.hidden
        ));
    }
    if w.data.is_empty() || !w.data.len().is_multiple_of(hidden) {
        return Err(format!(
            "{} values are not whole rows of {hidden}",
            w.data.len()
        ));
    }
    let rows = w.data.len() / hidden;
    if w.start as usize + rows > max_positions {
        return Err(format!(
            "positions {}..{} exceed the model's {max_positions}",
            w.start,
            w.start as usize + rows
        ));
    }
    if let Some(i) = w.data.iter().position(|v| !v.is_finite()) {
        return Err(format!(
            "non-finite value {} at position {}, channel {}",
            w.data[i],
            w.start as usize + i / hidden,
            i % hidden
        ));
    }
    Ok(Activations {
        start: w.start as usize,
        hidden,
        data: w.data,
    })
}

/// Converts activations for the wire.
pub fn to_wire(a: &Activations) -> WireActivations {
    WireActivations {
        start: a.start as u32,
        hidden: a.hidden as u32,
        data: a.data.clone(),
    }
}
