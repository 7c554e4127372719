//! Kubernetes quantities (`16Gi`, `4096Mi`, `1.5G`, `2e9`) as whole bytes, the unit device
//! capacity is counted in.
//!
//! Only what capacities and requests need: a non-negative number with an optional binary
//! (`Ki`…`Ei`), decimal (`n`, `u`, `m`, `k`…`E`) or exponent (`e3`) suffix. Fractions round up
//! to a whole unit, as `Quantity.Value()` (bytes) and `Quantity.MilliValue()` (millicores) do
//! upstream.

/// Bytes in one GiB.
pub const GIB: u128 = 1 << 30;

/// Why a quantity could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid quantity {0:?}: expected a non-negative number with an optional suffix such as Gi, Mi or G"
)]
pub struct QuantityError(pub String);

/// The quantity `text` in whole bytes (rounded up).
pub fn bytes(text: &str) -> Result<u128, QuantityError> {
    scaled(text, 1)
}

/// The quantity `text` in thousandths (rounded up): CPU in millicores.
pub fn milli(text: &str) -> Result<u128, QuantityError> {
    scaled(text, 1000)
}

/// The quantity `text` in MiB (rounded up): memory as the scheduling code counts it.
pub fn mib(text: &str) -> Result<u128, QuantityError> {
    bytes(text).map(|bytes| bytes.div_ceil(1 << 20))
}

/// The quantity `text` × `per_unit`, rounded up.
fn scaled(text: &str, per_unit: u128) -> Result<u128, QuantityError> {
    let invalid = || QuantityError(text.to_owned());
    let text_trimmed = text.trim();
    let text_trimmed = text_trimmed.strip_prefix('+').unwrap_or(text_trimmed);
    let split = text_trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text_trimmed.len());
    let (number, suffix) = text_trimmed.split_at(split);
    if number.is_empty() || number == "." {
        return Err(invalid());
    }
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if fraction.contains('.') || fraction.len() > 18 {
        return Err(invalid());
    }
    let digits = format!("{whole}{fraction}");
    let mantissa: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| invalid())?
    };
    // value = mantissa * numerator / denominator
    let mut denominator: u128 = 10u128.pow(u32::try_from(fraction.len()).map_err(|_| invalid())?);
    let numerator: u128 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        "m" | "u" | "n" => {
            let below = match suffix {
                "m" => 1_000,
                "u" => 1_000_000,
                _ => 1_000_000_000,
            };
            denominator = denominator.checked_mul(below).ok_or_else(invalid)?;
            1
        }
        exp if exp.starts_with(['e', 'E']) => {
            let power: u32 = exp[1..].parse().map_err(|_| invalid())?;
            10u128.checked_pow(power).ok_or_else(invalid)?
        }
        _ => return Err(invalid()),
    };
    let scaled = mantissa
        .checked_mul(numerator)
        .and_then(|value| value.checked_mul(per_unit))
        .ok_or_else(invalid)?;
    Ok(scaled.div_ceil(denominator))
}

/// `n` GiB as a quantity string (`4Gi`).
pub fn gib(n: u64) -> String {
    format!("{n}Gi")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_usual_forms() {
        assert_eq!(bytes("16Gi"), Ok(16 * GIB));
        assert_eq!(bytes("4096Mi"), Ok(4 * GIB));
        assert_eq!(bytes("1.5Gi"), Ok(3 * GIB / 2));
        assert_eq!(bytes("2G"), Ok(2_000_000_000));
        assert_eq!(bytes("2e3"), Ok(2000));
        assert_eq!(bytes("1500m"), Ok(2));
        assert_eq!(bytes("0"), Ok(0));
        assert_eq!(bytes("42"), Ok(42));
    }

    #[test]
    fn reads_cpu_in_millicores_and_memory_in_mib() {
        assert_eq!(milli("100m"), Ok(100));
        assert_eq!(milli("1.5"), Ok(1_500));
        assert_eq!(milli("2"), Ok(2_000));
        assert_eq!(milli("1500000n"), Ok(2));
        assert_eq!(milli("250u"), Ok(1));
        assert_eq!(mib("64Mi"), Ok(64));
        assert_eq!(mib("1G"), Ok(954));
        assert_eq!(mib("1"), Ok(1));
    }

    #[test]
    fn refuses_what_is_not_a_quantity() {
        for bad in ["", "Gi", "-1Gi", "1.2.3", "4GB", "x", "1e999"] {
            assert!(bytes(bad).is_err(), "{bad}");
        }
    }
}
