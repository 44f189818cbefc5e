//! Publishing the program's key types to the server
//! ([`Locker::publish_key_types`]), and reading them back
//! ([`published_key_types`]), so that `lockkit inspect` names the type
//! behind every key without the application's files.

use tokio_postgres::types::Type;
use tokio_postgres::Client;

use crate::engine::error::Error;
use crate::engine::sql;
use crate::key::linked::linked_key_types;
use crate::key::{KeyForm, KeySpec, LockKey};
use crate::pg::locker::Locker;

/// The namespace of the key that serializes publishers.
const PUBLISH_NAMESPACE: &str = "lockkit.key_types";

/// The key [`sql::PUBLISH_LOCK`] takes.
fn publish_key() -> LockKey {
    KeySpec::new(PUBLISH_NAMESPACE).key_of(&0_i64)
}

/// A key form as the table stores it.
fn form_name(form: KeyForm) -> &'static str {
    match form {
        KeyForm::BigInt => "bigint",
        KeyForm::Pair => "pair",
        KeyForm::PairExact => "pair_exact",
        KeyForm::Raw => "raw",
        KeyForm::HashText => "hashtext",
    }
}

fn form_from_name(name: &str) -> Option<KeyForm> {
    Some(match name {
        "bigint" => KeyForm::BigInt,
        "pair" => KeyForm::Pair,
        "pair_exact" => KeyForm::PairExact,
        "raw" => KeyForm::Raw,
        "hashtext" => KeyForm::HashText,
        _ => return None,
    })
}

/// One key type of one application, as published to the server.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PublishedKeyType {
    /// The application that published it.
    pub application: String,
    /// The type's path in that application (`billing::Invoice`).
    pub type_name: String,
    /// The type's namespace.
    pub namespace: String,
    /// Its key form.
    pub form: KeyForm,
    /// The class of its `Pair` keys.
    pub pair_class: i32,
}

impl PublishedKeyType {
    /// The type's key spec, or `None` when the row does not hold a valid
    /// namespace (the table is the application's to write, not lockkit's
    /// alone).
    pub fn spec(&self) -> Option<KeySpec<'_>> {
        let spec = KeySpec::try_new(&self.namespace).ok()?;
        Some(match self.form {
            KeyForm::BigInt => spec,
            KeyForm::Pair => spec.class(self.pair_class),
            KeyForm::PairExact => spec.exact().class(self.pair_class),
            KeyForm::Raw => spec.raw(),
            KeyForm::HashText => spec.hashtext(),
        })
    }
}

impl Locker {
    /// Publishes every key type of the program (every type deriving
    /// [`AdvisoryKey`](crate::AdvisoryKey), [`linked_key_types`](crate::key::linked_key_types))
    /// to the server as `application`'s, so that `lockkit inspect` names
    /// the type behind each of their keys. Opt-in: call it once at startup.
    ///
    /// The types go to the table `public.lockkit_key_types`
    /// ([`CREATE_KEY_TYPES`](crate::driver::sql::CREATE_KEY_TYPES)), which
    /// this creates when it is missing: one row per (application, type),
    /// with the namespace, its tag, the key form and the pair class.
    /// Publishing again updates the rows (a type whose spec changed gets
    /// its new one) and removes none. Publishers serialize on one advisory
    /// lock, so any number of them may run at once, on a fresh database
    /// too. Two namespaces that share a tag (or a pair class) are kept
    /// both; `lockkit inspect` reports them as a collision.
    ///
    /// Answers how many types were published.
    ///
    /// # Errors
    ///
    /// [`ErrorKind::Database`](crate::ErrorKind::Database) when a statement
    /// fails, e.g. `42501` when the role may not create the table (its owner
    /// can create it with
    /// [`CREATE_KEY_TYPES`](crate::driver::sql::CREATE_KEY_TYPES) and grant
    /// `SELECT, INSERT, UPDATE` on it); connection errors.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: everything runs in one transaction, rolled back before
    /// the client's next statement when the future is dropped.
    pub async fn publish_key_types(
        &self,
        client: &mut Client,
        application: &str,
    ) -> Result<usize, Error> {
        let mut types: Vec<_> = linked_key_types().collect();
        types.sort_by_key(|t| t.name());
        types.dedup_by_key(|t| t.name());
        let names: Vec<&str> = types.iter().map(|t| t.name()).collect();
        let namespaces: Vec<&str> = types.iter().map(|t| t.spec().namespace()).collect();
        let forms: Vec<&str> = types.iter().map(|t| form_name(t.spec().form())).collect();
        let tags: Vec<i32> = types.iter().map(|t| i32::from(t.spec().tag())).collect();
        let classes: Vec<i32> = types.iter().map(|t| t.spec().pair_class()).collect();
        let key = match publish_key() {
            LockKey::BigInt(key) => key,
            LockKey::Pair(..) => unreachable!("a hashed BigInt spec"),
        };
        let tx = client.transaction().await?;
        tx.query_typed(sql::PUBLISH_LOCK, &[(&key, Type::INT8)])
            .await?;
        tx.batch_execute(sql::CREATE_KEY_TYPES).await?;
        tx.query_typed(
            sql::PUBLISH_KEY_TYPES,
            &[
                (&application, Type::TEXT),
                (&names, Type::TEXT_ARRAY),
                (&namespaces, Type::TEXT_ARRAY),
                (&forms, Type::TEXT_ARRAY),
                (&tags, Type::INT4_ARRAY),
                (&classes, Type::INT4_ARRAY),
            ],
        )
        .await?;
        tx.commit().await?;
        Ok(types.len())
    }
}

/// The key types published to the server ([`Locker::publish_key_types`]),
/// or `None` when none ever were (the table does not exist). Rows whose
/// form lockkit does not know are left out.
///
/// # Errors
///
/// When a query fails, e.g. `42501` when the role may not read the table.
///
/// # Cancel safety
///
/// Cancel safe: it only reads.
pub async fn published_key_types(client: &Client) -> Result<Option<Vec<PublishedKeyType>>, Error> {
    let exists: bool = client
        .query_typed_one(sql::KEY_TYPES_EXIST, &[])
        .await?
        .try_get(0)?;
    if !exists {
        return Ok(None);
    }
    let rows = client.query_typed(sql::PUBLISHED_KEY_TYPES, &[]).await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let Some(form) = form_from_name(row.try_get(3)?) else {
            continue;
        };
        out.push(PublishedKeyType {
            application: row.try_get(0)?,
            type_name: row.try_get(1)?,
            namespace: row.try_get(2)?,
            form,
            pair_class: row.try_get(4)?,
        });
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_round_trip() {
        for form in [
            KeyForm::BigInt,
            KeyForm::Pair,
            KeyForm::PairExact,
            KeyForm::Raw,
            KeyForm::HashText,
        ] {
            assert_eq!(form_from_name(form_name(form)), Some(form));
        }
        assert_eq!(form_from_name("other"), None);
    }

    #[test]
    fn a_published_spec_is_the_type_spec() {
        let row = |form, pair_class| PublishedKeyType {
            application: "a".into(),
            type_name: "a::T".into(),
            namespace: "billing.invoice".into(),
            form,
            pair_class,
        };
        let spec = KeySpec::new("billing.invoice");
        assert_eq!(row(KeyForm::BigInt, 0).spec(), Some(spec));
        let pair = spec.pair();
        assert_eq!(
            row(KeyForm::Pair, pair.pair_class())
                .spec()
                .unwrap()
                .key_of(&9_u64),
            pair.key_of(&9_u64)
        );
        assert_eq!(
            row(KeyForm::Pair, 7).spec().unwrap().key_of(&9_u64),
            spec.class(7).key_of(&9_u64)
        );
        assert!(matches!(publish_key(), LockKey::BigInt(_)));
    }
}
