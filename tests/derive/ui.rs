//! Compile-fail cases: each `tests/ui/*.rs` is one mistake a user will make,
//! and its `.stderr` is the message they get.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui/*.rs");
}
