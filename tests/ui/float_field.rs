use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
struct Reading {
    sensor: u32,
    celsius: f64,
}

fn main() {}
