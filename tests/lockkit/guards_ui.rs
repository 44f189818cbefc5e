//! Compile-fail cases for the guarantees the types make (`tests/ui-guards/`):
//! a guard cannot outlive its transaction (used after `commit`/`rollback`,
//! returned from the function or block that owns the transaction, sent to a
//! spawned task), and there is no lock call outside a transaction, in either
//! adapter. Each `.stderr` is the compiler's message, naming the borrow that
//! forbids it; if a refactor lets a guard escape, the case compiles and this
//! test fails.

#[test]
fn guards_cannot_outlive_their_transaction() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui-guards/*.rs");
}
