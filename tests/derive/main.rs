//! `#[derive(AdvisoryKey)]`: KEYS.md golden vectors through the derive, every
//! option, every shape of type, and compile-fail cases (`ui`).

mod forms;
mod golden;
mod hash;
mod keys_doc;
mod linked;
mod props;
mod shapes;
mod spec_reimpl;
mod ui;
