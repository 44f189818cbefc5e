use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
#[advisory_key(stripes = 0)]
struct Event {
    business_key: String,
}

fn main() {}
