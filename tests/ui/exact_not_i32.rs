use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
#[advisory_key(pair = "exact")]
struct AccountId(i64);

fn main() {}
