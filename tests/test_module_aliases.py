"""The flower modules' former names stay importable (plug-ins written against them keep working)."""


def test_former_module_names_import_the_same_objects():
    from fedfuse.flower import client, client_replies, client_tiers, fusion_strategy, protocol, strategy, tier_client
    from fedfuse.flower import tiered, tiers

    assert strategy.FusionStrategy is fusion_strategy.FusionStrategy
    assert strategy.state_to_record is protocol.state_to_record
    assert strategy.ClientsDivergedError is protocol.ClientsDivergedError
    assert tiers.build_tier_strategy is tiered.build_tier_strategy and tiers.HeteroFLStrategy is tiered.HeteroFLStrategy
    assert tier_client.node_tier is client_tiers.node_tier and tier_client.OD_KEY == client_tiers.OD_KEY
    assert client.make_train_reply is client_replies.make_train_reply
