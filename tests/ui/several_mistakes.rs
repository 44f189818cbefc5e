use lockkit::AdvisoryKey;

// Every mistake is reported in one compile, and nothing else.
#[derive(AdvisoryKey)]
#[advisory_key(namespace = "", class = -1, stripes = 0)]
struct Order {
    #[advisory_key(skip, skip)]
    note: String,
    #[advisory_key(rename = "total")]
    total: f64,
}

fn main() {
    let _ = Order { note: String::new(), total: 0.0 }.lock_key();
}
