//! Implementation detail of `lockkit`: `#[derive(AdvisoryKey)]`.
use proc_macro::TokenStream;

/// Derives `lockkit::AdvisoryKey`.
#[proc_macro_derive(AdvisoryKey, attributes(advisory_key))]
pub fn derive_advisory_key(input: TokenStream) -> TokenStream {
    let _ = input;
    TokenStream::new()
}
