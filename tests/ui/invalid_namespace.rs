use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "billing orders")]
struct Order {
    id: i64,
}

fn main() {}
