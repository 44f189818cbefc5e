use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
#[advisory_key(raw)]
struct JobId(u64);

fn main() {}
