//! Key types shared by the key benchmark (`benches/keys.rs`) and the
//! zero-allocation test (`alloc/main.rs`), so the test checks exactly the
//! keys the benchmark measures.

use lockkit::AdvisoryKey;

/// A `Uuid` key.
#[derive(AdvisoryKey, Debug)]
pub struct Document {
    /// The document id.
    pub id: uuid::Uuid,
}

/// A `(String, u64)` key.
#[derive(AdvisoryKey, Debug)]
pub struct Tenanted {
    /// The tenant.
    pub tenant: String,
    /// The id within the tenant.
    pub id: u64,
}

/// A 5-field key.
#[derive(AdvisoryKey, Debug)]
pub struct Posting {
    /// The account.
    pub account: i64,
    /// The currency code.
    pub currency: String,
    /// The day number.
    pub day: u32,
    /// Whether the posting reverses another.
    pub reversal: bool,
    /// The batch it came in, if any.
    pub batch: Option<uuid::Uuid>,
}

/// [`Tenanted`] in the `Pair` key space.
#[derive(AdvisoryKey, Debug)]
#[advisory_key(namespace = "Tenanted", pair)]
pub struct TenantedPair {
    /// The tenant.
    pub tenant: String,
    /// The id within the tenant.
    pub id: u64,
}

/// A striped key: every business key folds onto 1024 keys.
#[derive(AdvisoryKey, Debug)]
#[advisory_key(namespace = "Event", stripes = 1024)]
pub struct StripedEvent {
    /// The business key.
    pub business_key: String,
}

/// The key of the multiplexed session-lock tests and benchmark rows, also
/// taken by the `hold-session-locks` child process (tests/src/bin), so that
/// a test and the process it kills lock the same keys.
#[derive(AdvisoryKey, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[advisory_key(namespace = "lockkit-tests/multiplexed")]
pub struct Feed {
    /// The feed id.
    pub id: i64,
}
