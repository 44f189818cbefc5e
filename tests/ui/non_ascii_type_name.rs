use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
struct Größe {
    id: i64,
}

fn main() {}
