//! Type options: explicit namespace, explicit class, exact mode, raw keys,
//! `crate = "..."`.

use lockkit::key::KeyForm;
use lockkit::{AdvisoryKey, KeySpec, LockKey};

/// A renamed type keeps its keys with an explicit namespace.
#[derive(AdvisoryKey)]
#[advisory_key(namespace = "Order")]
struct PurchaseOrder {
    id: i64,
}

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "billing.v2/invoice:item-1_x")]
struct Invoice {
    id: i64,
}

#[test]
fn explicit_namespace_keeps_the_key_of_a_renamed_type() {
    assert_eq!(
        PurchaseOrder { id: 42 }.lock_key(),
        LockKey::BigInt(-7205368663365046133)
    );
    assert_eq!(PurchaseOrder::KEY_SPEC.namespace(), "Order");
    assert_eq!(Invoice::KEY_SPEC.namespace(), "billing.v2/invoice:item-1_x");
    assert_eq!(
        Invoice { id: 42 }.lock_key(),
        KeySpec::new("billing.v2/invoice:item-1_x").key_of(&42_i64)
    );
    assert_ne!(
        Invoice { id: 42 }.lock_key(),
        PurchaseOrder { id: 42 }.lock_key()
    );
}

#[derive(AdvisoryKey)]
#[advisory_key(pair, class = -17)]
struct Order {
    id: i64,
}

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "Order", pair, class = 2147483647i32)]
struct MaxClass {
    id: i64,
}

#[derive(AdvisoryKey)]
#[advisory_key(namespace = "Order", pair, class = -2147483648)]
struct MinClass {
    id: i64,
}

#[test]
fn explicit_class_replaces_only_the_class() {
    // The object is the golden one of `Order { id: 42 }` in the Pair column.
    assert_eq!(Order { id: 42 }.lock_key(), LockKey::Pair(-17, 1483026571));
    assert_eq!(
        MaxClass { id: 42 }.lock_key(),
        LockKey::Pair(i32::MAX, 1483026571)
    );
    assert_eq!(
        MinClass { id: 42 }.lock_key(),
        LockKey::Pair(i32::MIN, 1483026571)
    );
    assert_eq!(Order::KEY_SPEC.form(), KeyForm::Pair);
    assert_eq!(Order::KEY_SPEC.pair_class(), -17);
}

mod exact {
    use lockkit::AdvisoryKey;

    #[derive(AdvisoryKey)]
    #[advisory_key(pair = "exact")]
    pub(super) struct Order(pub(super) i32);

    #[derive(AdvisoryKey)]
    #[advisory_key(pair = "exact", class = 7)]
    pub(super) struct Account {
        pub(super) id: i32,
    }
}

#[test]
fn exact_mode_uses_the_value_as_the_object() {
    // Class: the high half of ns_hash("Order"), as in the golden Pair vector.
    assert_eq!(exact::Order(42).lock_key(), LockKey::Pair(-1677652607, 42));
    assert_eq!(exact::Order(-1).lock_key(), LockKey::Pair(-1677652607, -1));
    assert_eq!(
        exact::Order(i32::MIN).lock_key(),
        LockKey::Pair(-1677652607, i32::MIN)
    );
    assert_eq!(exact::Account { id: 5 }.lock_key(), LockKey::Pair(7, 5));
    assert_eq!(exact::Order::KEY_SPEC.form(), KeyForm::PairExact);
    assert_eq!(exact::Account::KEY_SPEC.form(), KeyForm::PairExact);
}

#[derive(AdvisoryKey)]
#[advisory_key(raw)]
struct LegacyJobId(i64);

#[derive(AdvisoryKey)]
#[advisory_key(raw)]
struct LegacyPair((i32, i32));

#[derive(AdvisoryKey)]
#[advisory_key(raw)]
struct LegacyNamed {
    id: core::primitive::i64,
}

#[test]
fn raw_keys_are_the_value() {
    for v in [0, 9, -5, i64::MIN, i64::MAX] {
        assert_eq!(LegacyJobId(v).lock_key(), LockKey::BigInt(v));
        assert_eq!(LegacyNamed { id: v }.lock_key(), LockKey::BigInt(v));
    }
    assert_eq!(LegacyPair((3, -4)).lock_key(), LockKey::Pair(3, -4));
    assert_eq!(
        LegacyPair((i32::MIN, i32::MAX)).lock_key(),
        LockKey::Pair(i32::MIN, i32::MAX)
    );
    assert_eq!(LegacyJobId::KEY_SPEC.form(), KeyForm::Raw);
    assert_eq!(LegacyPair::KEY_SPEC.form(), KeyForm::Raw);
    // As a part of another key, a raw key type encodes its value.
    assert_eq!(
        lockkit::key::parts_bytes(&LegacyJobId(9)),
        lockkit::key::parts_bytes(&9_i64)
    );
}

mod reexport {
    pub(crate) use lockkit as renamed;
}

#[derive(AdvisoryKey)]
#[advisory_key(crate = "crate::forms::reexport::renamed", namespace = "Order")]
struct ThroughReexport {
    id: i64,
}

#[test]
fn crate_path_is_used() {
    assert_eq!(
        ThroughReexport { id: 42 }.lock_key(),
        LockKey::BigInt(-7205368663365046133)
    );
}

#[derive(AdvisoryKey)]
#[allow(non_camel_case_types)]
struct r#match {
    id: i64,
}

#[test]
fn raw_identifier_namespace_has_no_prefix() {
    assert_eq!(r#match::KEY_SPEC.namespace(), "match");
    assert_eq!(
        r#match { id: 1 }.lock_key(),
        KeySpec::new("match").key_of(&1_i64)
    );
}
