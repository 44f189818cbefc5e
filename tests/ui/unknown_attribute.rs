use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
#[advisory_key(stripe = 1024)]
struct Event {
    business_key: String,
}

fn main() {}
