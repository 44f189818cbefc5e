use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
union Id {
    signed: i64,
    unsigned: u64,
}

fn main() {}
