use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
struct Quote {
    symbol: String,
    limit: Option<f32>,
}

fn main() {}
