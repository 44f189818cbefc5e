use lockkit::AdvisoryKey;

/// Forgot `#[derive(AdvisoryKey)]`.
struct CustomerId(u64);

#[derive(AdvisoryKey)]
struct Order {
    customer: CustomerId,
    id: u64,
}

fn main() {}
