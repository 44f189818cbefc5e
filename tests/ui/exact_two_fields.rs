use lockkit::AdvisoryKey;

#[derive(AdvisoryKey)]
#[advisory_key(pair = "exact", class = 7)]
struct Seat {
    row: i32,
    number: i32,
}

fn main() {}
