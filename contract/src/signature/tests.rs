use super::*;
use crate::ContainerRequest;

const K1: &str = "k1:AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";
const K2: &str = "k2:AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=";

fn sample() -> PodAllocation {
    PodAllocation {
        gpu_index: 1,
        gpu_uuid: "GPU-a".into(),
        more_gpus: vec![],
        pod_gib: 6,
        exclusive: false,
        containers: vec![
            ContainerRequest {
                name: "init".into(),
                gib: 6,
                init: true,
                compute: 0,
            },
            ContainerRequest {
                name: "main".into(),
                gib: 4,
                init: false,
                compute: 0,
            },
        ],
        bind_time: "2026-11-22T10:00:00Z".into(),
        assigned: false,
        allocated: vec![],
        signature: None,
        compute: 0,
    }
}

fn signed(keyring: &Keyring, uid: &str, node: &str) -> PodAllocation {
    let mut allocation = sample();
    allocation.signature = Some(keyring.sign(uid, node, &allocation));
    allocation
}

#[test]
fn canonical_form_is_stable() {
    let allocation = PodAllocation {
        containers: vec![ContainerRequest {
            name: "m".into(),
            gib: 2,
            init: true,
            compute: 0,
        }],
        ..sample()
    };
    let mut want = FORM_V1_TAG.to_vec();
    want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1, b'u']);
    want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 2, b'n', b'1']);
    want.extend_from_slice(&[0, 0, 0, 1]);
    want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 5, b'G', b'P', b'U', b'-', b'a']);
    want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 6]);
    want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1]);
    want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1, b'm']);
    want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 2, 1]);
    assert_eq!(canonical_v1("u", "n1", &allocation), want);
    // And the signature of a fixed input under a fixed key, as deployed pods carry it:
    // changing the form breaks every signed pod in a cluster (value checked independently
    // with Python's hmac module).
    let keyring = Keyring::parse(K1).unwrap();
    assert_eq!(
        keyring.sign("uid-1", "n1", &sample()),
        "k1:v8ZA1u/hnpnmVGueA/nAetR0FMYH3VRImmZ22GsfrlU="
    );
}

#[test]
fn multi_gpu_fields_are_signed_in_a_tail() {
    let keyring = Keyring::parse(K1).unwrap();
    let mut multi = PodAllocation {
        more_gpus: vec![crate::GpuRef {
            index: 0,
            uuid: "GPU-b".into(),
        }],
        ..sample()
    };
    let plain = canonical_v1("u", "n1", &sample());
    let tailed = canonical_v1("u", "n1", &multi);
    assert_eq!(&tailed[..plain.len()], &plain[..]);
    let mut tail = vec![0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];
    tail.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 5, b'G', b'P', b'U', b'-', b'b', 0]);
    assert_eq!(&tailed[plain.len()..], &tail[..]);
    multi.signature = Some(keyring.sign("u", "n1", &multi));
    assert_eq!(keyring.verify("u", "n1", &multi), Ok("k1"));
    // Swapping which GPU is first changes the decision.
    let mut swapped = multi.clone();
    std::mem::swap(&mut swapped.gpu_index, &mut swapped.more_gpus[0].index);
    std::mem::swap(&mut swapped.gpu_uuid, &mut swapped.more_gpus[0].uuid);
    assert_eq!(
        keyring.verify("u", "n1", &swapped),
        Err(Unverified::Mismatch)
    );
    // Dropping the extra GPU and the exclusive flag (an attempt to pass a multi-GPU
    // decision off as a one-GPU one) fails too.
    let mut dropped = multi;
    dropped.more_gpus.clear();
    assert_eq!(
        keyring.verify("u", "n1", &dropped),
        Err(Unverified::Mismatch)
    );
}

#[test]
fn fields_outside_the_decision_are_not_signed() {
    let keyring = Keyring::parse(K1).unwrap();
    let mut allocation = signed(&keyring, "uid-1", "n1");
    allocation.bind_time = "later".into();
    allocation.assigned = true;
    allocation.allocated = vec!["init".into()];
    assert_eq!(keyring.verify("uid-1", "n1", &allocation), Ok("k1"));
}

#[test]
fn signed_allocations_verify_and_tampering_any_field_fails() {
    let keyring = Keyring::parse(K1).unwrap();
    let good = signed(&keyring, "uid-1", "n1");
    assert_eq!(keyring.verify("uid-1", "n1", &good), Ok("k1"));
    // Another pod (a copy of the annotations), another node.
    assert_eq!(
        keyring.verify("uid-2", "n1", &good),
        Err(Unverified::Mismatch)
    );
    assert_eq!(
        keyring.verify("uid-1", "n2", &good),
        Err(Unverified::Mismatch)
    );
    type Tamper = fn(&mut PodAllocation);
    let tampered: &[(&str, Tamper)] = &[
        ("gpu index", |a| a.gpu_index = 0),
        ("gpu uuid", |a| a.gpu_uuid = "GPU-b".into()),
        ("pod gib", |a| a.pod_gib = 1),
        ("container name", |a| a.containers[1].name = "x".into()),
        ("container gib", |a| a.containers[1].gib = 1),
        ("container init", |a| a.containers[0].init = false),
        ("compute", |a| a.compute = 30),
        ("container compute", |a| a.containers[0].compute = 30),
        ("container dropped", |a| drop(a.containers.pop())),
        ("container added", |a| {
            a.containers.push(ContainerRequest {
                name: "side".into(),
                gib: 1,
                init: false,
                compute: 0,
            })
        }),
        ("containers reordered", |a| a.containers.reverse()),
        ("gpu added", |a| {
            a.more_gpus.push(crate::GpuRef {
                index: 3,
                uuid: "GPU-d".into(),
            })
        }),
        ("made exclusive", |a| a.exclusive = true),
    ];
    for (what, change) in tampered {
        let mut allocation = good.clone();
        change(&mut allocation);
        assert_eq!(
            keyring.verify("uid-1", "n1", &allocation),
            Err(Unverified::Mismatch),
            "{what}"
        );
    }
}

#[test]
fn missing_malformed_and_foreign_signatures_fail() {
    let keyring = Keyring::parse(K1).unwrap();
    let mut allocation = sample();
    assert_eq!(
        keyring.verify("uid-1", "n1", &allocation),
        Err(Unverified::Unsigned)
    );
    for bad in ["k1", "k1:not base64!", "k1:AAAA", "bad id:AAAA", ":"] {
        allocation.signature = Some(bad.into());
        assert_eq!(
            keyring.verify("uid-1", "n1", &allocation),
            Err(Unverified::Malformed),
            "{bad}"
        );
    }
    // Signed with a key this keyring does not hold, under its id or another one.
    let other = Keyring::parse("k1:AwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwM=").unwrap();
    let forged = signed(&other, "uid-1", "n1");
    assert_eq!(
        keyring.verify("uid-1", "n1", &forged),
        Err(Unverified::Mismatch)
    );
    let stranger = Keyring::parse(K2).unwrap();
    let forged = signed(&stranger, "uid-1", "n1");
    assert_eq!(
        keyring.verify("uid-1", "n1", &forged),
        Err(Unverified::UnknownKey("k2".into()))
    );
}

#[test]
fn rotation_signs_with_the_first_key_and_verifies_with_every_listed_one() {
    let old = Keyring::parse(K1).unwrap();
    let by_old = signed(&old, "uid-1", "n1");
    // Step 1: the new key is listed second. Still signs with k1.
    let step1 = Keyring::parse(&format!("{K1}\n{K2}\n")).unwrap();
    assert!(step1.sign("uid-1", "n1", &sample()).starts_with("k1:"));
    // Step 2: the new key first. Signs with k2; k1's signatures still verify.
    let step2 = Keyring::parse(&format!("{K2}\n{K1}\n")).unwrap();
    let by_new = signed(&step2, "uid-1", "n1");
    assert!(by_new.signature.as_deref().unwrap().starts_with("k2:"));
    assert_eq!(step2.verify("uid-1", "n1", &by_old), Ok("k1"));
    assert_eq!(step1.verify("uid-1", "n1", &by_new), Ok("k2"));
    // Step 3: the old key removed; what it signed no longer verifies.
    let step3 = Keyring::parse(K2).unwrap();
    assert_eq!(step3.verify("uid-1", "n1", &by_new), Ok("k2"));
    assert_eq!(
        step3.verify("uid-1", "n1", &by_old),
        Err(Unverified::UnknownKey("k1".into()))
    );
}

#[test]
fn malformed_keyrings_name_the_line_and_never_the_key() {
    let cases = [
        ("# only a comment\n\n", "holds no key"),
        (
            "k1:AQEBAQEBAQEBAQEBAQEBAQ==\nk2 AQEB",
            "line 2: expected `id:base64key`",
        ),
        ("k 1:AQEBAQEBAQEBAQEBAQEBAQ==", "line 1: key id \"k 1\""),
        (":AQEBAQEBAQEBAQEBAQEBAQ==", "line 1: key id \"\""),
        (
            "k1:c2VjcmV0!!",
            "line 1: the key of \"k1\" is not standard base64",
        ),
        ("k1:c2VjcmV0", "line 1: the key of \"k1\" is 6 bytes"),
        (
            "k1:AQEBAQEBAQEBAQEBAQEBAQ==\n\nk1:AgICAgICAgICAgICAgICAg==",
            "line 3: key id \"k1\" is already used on line 1",
        ),
    ];
    for (text, want) in cases {
        let error = Keyring::parse(text).unwrap_err().to_string();
        assert!(error.contains(want), "{text:?}: {error}");
        assert!(
            !error.contains("c2VjcmV0") && !error.contains("AQEB"),
            "{error}"
        );
    }
    let keyring = Keyring::parse(&format!("# signing key first\n  {K2}  \r\n{K1}")).unwrap();
    assert_eq!(keyring.ids().collect::<Vec<_>>(), ["k2", "k1"]);
    assert_eq!(keyring.signing_id(), "k2");
    assert_eq!(format!("{keyring:?}"), r#"Keyring { ids: ["k2", "k1"] }"#);
}

#[test]
fn the_file_is_reloaded_when_it_changes_and_a_bad_one_keeps_the_old_keys() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys");
    std::fs::write(&path, "k1:AQEB").unwrap();
    let error = KeyringFile::open(&path).unwrap_err().to_string();
    assert!(
        error.contains(&path.display().to_string()) && error.contains("line 1"),
        "{error}"
    );

    std::fs::write(&path, K1).unwrap();
    let mut file = KeyringFile::open(&path).unwrap();
    let shared = file.keyring();
    let generation = shared.generation();
    assert_eq!(file.reload().unwrap(), Reload::Unchanged);
    std::fs::write(&path, format!("{K1}\n{K2}")).unwrap();
    assert_eq!(
        file.reload().unwrap(),
        Reload::Replaced(vec!["k1".into(), "k2".into()])
    );
    assert_eq!(shared.current().ids().count(), 2);
    assert!(shared.generation() > generation);
    // A broken edit is reported once and the keys in use stay.
    std::fs::write(&path, "k1:???").unwrap();
    assert!(file.reload().is_err());
    assert_eq!(file.reload().unwrap(), Reload::Unchanged);
    assert_eq!(shared.current().ids().count(), 2);
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(file.reload(), Err(KeyringError::Read { .. })));
    assert_eq!(file.reload().unwrap(), Reload::Unchanged);
    std::fs::write(&path, K2).unwrap();
    assert_eq!(file.reload().unwrap(), Reload::Replaced(vec!["k2".into()]));
}
