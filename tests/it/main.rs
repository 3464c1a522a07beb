//! The one integration test binary; each area has its own module.

mod provider;
