use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "billing.order")]
#[advisory_key(namespace = "orders")]
struct Order {
    id: i64,
}

fn main() {}
