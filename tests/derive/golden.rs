//! The golden vectors of KEYS.md, reproduced through `#[derive(AdvisoryKey)]`.
//! Never change a number here: each is part of the on-database protocol.

use lockkit::key::KeyForm;
use lockkit::{AdvisoryKey, LockKey};

/// The BigInt column: the derive's default key space.
mod bigint {
    use lockkit::AdvisoryKey;

    #[derive(AdvisoryKey)]
    pub(super) struct Order {
        pub(super) id: i64,
    }

    pub(super) mod narrow {
        use lockkit::AdvisoryKey;

        #[derive(AdvisoryKey)]
        pub(in crate::golden) struct Order {
            pub(in crate::golden) id: i32,
        }
    }

    #[derive(AdvisoryKey)]
    pub(super) struct Event {
        pub(super) business_key: String,
    }

    #[derive(AdvisoryKey)]
    pub(super) struct Transfer {
        pub(super) from: i64,
        pub(super) to: i64,
    }

    #[derive(AdvisoryKey)]
    pub(super) struct Tenanted<'a> {
        pub(super) tenant: &'a str,
        pub(super) id: u64,
    }

    pub(super) mod striped {
        use lockkit::AdvisoryKey;

        #[derive(AdvisoryKey)]
        #[advisory_key(stripes = 1024)]
        pub(in crate::golden) struct Event {
            pub(in crate::golden) business_key: String,
        }
    }
}

/// The Pair column: the same types with `#[advisory_key(pair)]`.
mod pair {
    use lockkit::AdvisoryKey;

    #[derive(AdvisoryKey)]
    #[advisory_key(pair)]
    pub(super) struct Order {
        pub(super) id: i64,
    }

    pub(super) mod narrow {
        use lockkit::AdvisoryKey;

        #[derive(AdvisoryKey)]
        #[advisory_key(pair)]
        pub(in crate::golden) struct Order {
            pub(in crate::golden) id: i32,
        }
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(pair)]
    pub(super) struct Event {
        pub(super) business_key: String,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(pair)]
    pub(super) struct Transfer {
        pub(super) from: i64,
        pub(super) to: i64,
    }

    #[derive(AdvisoryKey)]
    #[advisory_key(pair)]
    pub(super) struct Tenanted<'a> {
        pub(super) tenant: &'a str,
        pub(super) id: u64,
    }

    pub(super) mod striped {
        use lockkit::AdvisoryKey;

        #[derive(AdvisoryKey)]
        #[advisory_key(pair, stripes = 1024)]
        pub(in crate::golden) struct Event {
            pub(in crate::golden) business_key: String,
        }
    }
}

#[test]
fn order_i64() {
    assert_eq!(
        bigint::Order { id: 42 }.lock_key(),
        LockKey::BigInt(-7205368663365046133)
    );
    assert_eq!(
        pair::Order { id: 42 }.lock_key(),
        LockKey::Pair(-1677652607, 1483026571)
    );
}

#[test]
fn order_i32() {
    assert_eq!(
        bigint::narrow::Order { id: 42 }.lock_key(),
        LockKey::BigInt(-7205368663365046133)
    );
    assert_eq!(
        pair::narrow::Order { id: 42 }.lock_key(),
        LockKey::Pair(-1677652607, 1483026571)
    );
}

#[test]
fn event_string() {
    let key = String::from("a1b2c3d4");
    assert_eq!(
        bigint::Event {
            business_key: key.clone()
        }
        .lock_key(),
        LockKey::BigInt(5974391131006264455)
    );
    assert_eq!(
        pair::Event { business_key: key }.lock_key(),
        LockKey::Pair(1391066944, 2027906183)
    );
}

#[test]
fn transfer_two_fields() {
    assert_eq!(
        bigint::Transfer { from: 7, to: 3 }.lock_key(),
        LockKey::BigInt(-7316124675795688780)
    );
    assert_eq!(
        pair::Transfer { from: 7, to: 3 }.lock_key(),
        LockKey::Pair(-1703437380, -1363516748)
    );
    // Declaration order matters: swapping the values is another entity.
    assert_ne!(
        bigint::Transfer { from: 3, to: 7 }.lock_key(),
        LockKey::BigInt(-7316124675795688780)
    );
}

#[test]
fn tenanted_borrowed_str_and_u64() {
    let tenant = String::from("acme");
    let bigint = bigint::Tenanted {
        tenant: &tenant,
        id: 1001,
    };
    assert_eq!(bigint.lock_key(), LockKey::BigInt(-297873912991975939));
    let pair = pair::Tenanted {
        tenant: &tenant,
        id: 1001,
    };
    assert_eq!(pair.lock_key(), LockKey::Pair(-69385857, 474084861));
}

#[test]
fn event_striped_1024() {
    let key = || String::from("a1b2c3d4");
    assert_eq!(
        bigint::striped::Event {
            business_key: key()
        }
        .lock_key(),
        LockKey::BigInt(5974306380683673735)
    );
    assert_eq!(
        pair::striped::Event {
            business_key: key()
        }
        .lock_key(),
        LockKey::Pair(1391066944, 135)
    );
    assert_eq!(bigint::striped::Event::KEY_SPEC.stripe_count(), Some(1024));
    assert_eq!(pair::striped::Event::KEY_SPEC.stripe_count(), Some(1024));
}

#[test]
fn specs_name_the_type() {
    assert_eq!(bigint::Order::KEY_SPEC.namespace(), "Order");
    assert_eq!(bigint::Order::KEY_SPEC.form(), KeyForm::BigInt);
    assert_eq!(pair::Order::KEY_SPEC.form(), KeyForm::Pair);
    assert_eq!(bigint::Tenanted::KEY_SPEC.namespace(), "Tenanted");
    // KEYS.md: tag16("Order") = 0x9c01, and a BigInt key carries it.
    assert_eq!(bigint::Order::KEY_SPEC.tag(), 0x9c01);
    assert_eq!(bigint::Order { id: 7 }.lock_key().tag(), Some(0x9c01));
    assert_eq!(bigint::Order::KEY_SPEC.stripe_count(), None);
}
