use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
#[advisory_key(raw, stripes = 64)]
struct JobId(i64);

fn main() {}
