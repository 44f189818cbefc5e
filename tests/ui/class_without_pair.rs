use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
#[advisory_key(class = 7)]
struct Order {
    id: i64,
}

fn main() {}
