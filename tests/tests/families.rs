//! The family registry and the fixtures agree: every family shimmer registers
//! (`shimmer_common::families::FAMILIES`) has an oracle fixture, and every fixture is of a
//! registered family — so the tests that iterate the fixtures cover every family.

use shimmer_common::families::FAMILIES;
use shimmer_common::ModelSpec;
use shimmer_tests::{fixture, fixtures};

#[test]
fn every_registered_family_has_an_oracle_fixture_and_every_fixture_a_family() {
    let of_fixtures: Vec<(&str, &str)> = fixtures().into_iter().map(|name| (name, ModelSpec::from_dir(&fixture(name)).unwrap().architecture)).collect();
    for family in FAMILIES {
        assert!(of_fixtures.iter().any(|(_, a)| *a == family.architecture), "{} has no oracle fixture (tests/oracle/make_fixtures.py)", family.architecture);
    }
    for (name, architecture) in &of_fixtures {
        assert!(FAMILIES.iter().any(|f| f.architecture == *architecture), "fixture {name} is of {architecture}, which no family file registers");
    }
    assert!(of_fixtures.len() >= FAMILIES.len());
}
