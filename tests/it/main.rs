//! The one integration test binary: each area of the crate has its own module.

mod emulator;
