package kubeharness

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/client-go/tools/record"
	"k8s.io/kubernetes/pkg/volume"
)

const fsGroup int64 = 2000

// mounted is one pod's volume as kubelet holds it.
type mounted struct {
	pod     *v1.Pod
	volName string
	mounter volume.Mounter
	dir     string
}

// setUp is kubelet's MountVolume for a non-attachable flex plugin: NewMounter then SetUp
// with the pod's fsGroup. It returns the mount call's options as the driver received them.
func (k *kubelet) setUp(spec *volume.Spec, pod *v1.Pod, group *int64) (mounted, map[string]string) {
	k.t.Helper()
	m, err := k.plugin.NewMounter(spec, pod)
	if err != nil {
		k.t.Fatalf("NewMounter(%s): %v", spec.Name(), err)
	}
	mark := k.rec.mark()
	if err := m.SetUp(volume.MounterArgs{FsGroup: group, Recorder: record.NewFakeRecorder(16)}); err != nil {
		k.t.Fatalf("SetUp(%s) for pod %s: %v", spec.Name(), pod.Name, err)
	}
	c := k.oneCall(mark, "mount")
	dir := m.GetPath()
	if len(c.Argv) != 4 || c.Argv[2] != dir {
		k.t.Fatalf("mount argv: want [exe mount %s <json>], got %v", dir, maskArgv(c.Argv))
	}
	var opts map[string]string
	if err := json.Unmarshal([]byte(c.Argv[3]), &opts); err != nil {
		k.t.Fatalf("mount JSON: %v", err)
	}
	if !isMounted(k.t, dir) {
		k.t.Fatalf("SetUp of %s answered Success but %s is not a mount point", spec.Name(), dir)
	}
	return mounted{pod: pod, volName: spec.Name(), mounter: m, dir: dir}, opts
}

// tearDown is kubelet's UnmountVolume: NewUnmounter(volName, podUID).TearDown(), which
// calls `unmount <dir>` and then removes the directory itself (os.Remove).
func (k *kubelet) tearDown(volName string, pod *v1.Pod, dir string) {
	k.t.Helper()
	u, err := k.plugin.NewUnmounter(volName, pod.UID)
	if err != nil {
		k.t.Fatalf("NewUnmounter: %v", err)
	}
	if u.GetPath() != dir {
		k.t.Fatalf("unmounter path %s, mounter path %s", u.GetPath(), dir)
	}
	mark := k.rec.mark()
	if err := u.TearDown(); err != nil {
		k.t.Fatalf("TearDown(%s) of pod %s: %v", volName, pod.Name, err)
	}
	c := k.oneCall(mark, "unmount")
	if len(c.Argv) != 3 || c.Argv[2] != dir {
		k.t.Fatalf("unmount argv: want [exe unmount %s], got %v", dir, c.Argv)
	}
	if isMounted(k.t, dir) || exists(dir) {
		k.t.Fatalf("after TearDown %s is still there (mounted: %v)", dir, isMounted(k.t, dir))
	}
}

func statfsBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		t.Fatalf("statfs %s: %v", dir, err)
	}
	return int64(st.Blocks) * st.Bsize
}

func checkOptions(t *testing.T, opts map[string]string, want map[string]string) {
	t.Helper()
	for k, v := range want {
		if got, ok := opts[k]; !ok || got != v {
			t.Errorf("mount option %s: want %q, got %q (present %v)", k, v, masked(got), ok)
		}
	}
}

// TestLifecycle takes one volume of the configured backend through everything kubelet does
// with it, with the real plugin code, the real exec and the real mount table.
func TestLifecycle(t *testing.T) {
	cfg := loadConfig(t)
	e := newEnv(t, cfg, v1.SecretType(driverName))
	k := e.start(t)

	// init: exactly `<exe> init`; the capabilities the real code parsed.
	if calls := k.rec.since(0); len(calls) != 1 || len(calls[0].Argv) != 2 || calls[0].Argv[0] != e.driverExe || calls[0].op() != "init" {
		t.Fatalf("plugin creation: want one `%s init`, got %v", e.driverExe, k.rec.ops())
	}
	if k.plugin.GetPluginName() != driverName {
		t.Fatalf("plugin name %q", k.plugin.GetPluginName())
	}
	if _, ok := k.plugin.(volume.AttachableVolumePlugin); ok {
		t.Fatal("flexhub says attach:false, but the real code made an attachable plugin")
	}
	expander, ok := k.plugin.(volume.NodeExpandableVolumePlugin)
	if !ok || !expander.RequiresFSResize() {
		t.Fatal("the real code does not see requiresFSResize")
	}

	const pvName = "pv-kh"
	pv := e.pv(pvName, cfg.capacity)
	spec := volume.NewSpecFromPersistentVolume(pv, false)

	// GetVolumeName: one getvolumename with the PV's options; the name is the PV's.
	mark := k.rec.mark()
	name, err := k.plugin.GetVolumeName(spec)
	if err != nil || name != pvName {
		t.Fatalf("GetVolumeName = %q, %v", name, err)
	}
	c := k.oneCall(mark, "getvolumename")
	var gvn map[string]string
	if err := json.Unmarshal([]byte(c.Argv[2]), &gvn); err != nil || gvn["kubernetes.io/pvOrVolumeName"] != pvName {
		t.Fatalf("getvolumename JSON %v (%v)", maskArgv(c.Argv), err)
	}

	// Pod A: read-write, fsGroup; write data through the mount.
	group := fsGroup
	podA := newPod("a")
	a, opts := k.setUp(spec, podA, &group)
	want := map[string]string{
		"kubernetes.io/pvOrVolumeName":      pvName,
		"kubernetes.io/readwrite":           "rw",
		"kubernetes.io/fsType":              cfg.fsType,
		"kubernetes.io/pod.name":            "a",
		"kubernetes.io/pod.namespace":       namespace,
		"kubernetes.io/pod.uid":             string(podA.UID),
		"kubernetes.io/serviceAccount.name": "sa-a",
		"kubernetes.io/mounterArgs.FsGroup": "2000",
	}
	for k, v := range cfg.options {
		want[k] = v
	}
	for key, v := range cfg.secret {
		want["kubernetes.io/secret/"+key] = base64.StdEncoding.EncodeToString([]byte(v))
	}
	checkOptions(t, opts, want)
	attrs := a.mounter.GetAttributes()
	if attrs.ReadOnly || !attrs.Managed || !attrs.SELinuxRelabel {
		t.Errorf("GetAttributes = %+v, want read-write, managed, SELinux relabel", attrs)
	}
	payload := []byte("written through pod a " + string(podA.UID))
	if err := os.WriteFile(filepath.Join(a.dir, "kh-data"), payload, 0o644); err != nil {
		t.Fatalf("pod a cannot write: %v", err)
	}
	if cfg.fsGroupRoot {
		var st syscall.Stat_t
		if err := syscall.Stat(a.dir, &st); err != nil {
			t.Fatal(err)
		}
		if int64(st.Gid) != fsGroup || st.Mode&syscall.S_ISGID == 0 {
			t.Errorf("volume root: gid %d mode %o, want gid %d with setgid (flexhub applies fsGroup)", st.Gid, st.Mode&0o7777, fsGroup)
		}
	}

	// A second SetUp of a mounted directory: kubelet's "already mounted?" check, no driver call.
	mark = k.rec.mark()
	if err := a.mounter.SetUp(volume.MounterArgs{FsGroup: &group, Recorder: record.NewFakeRecorder(16)}); err != nil {
		t.Fatalf("second SetUp: %v", err)
	}
	k.noCalls(mark, "SetUp of a directory that is already a mount point")

	// Pod B: the same volume, sees the data.
	podB := newPod("b")
	b, _ := k.setUp(spec, podB, nil)
	if got, err := os.ReadFile(filepath.Join(b.dir, "kh-data")); err != nil || string(got) != string(payload) {
		t.Fatalf("pod b reads %q, %v; want pod a's data", got, err)
	}

	// Pod C: a read-only claim (spec.ReadOnly from the PVC source): sees the data, cannot write.
	podC := newPod("c")
	cMount, cOpts := k.setUp(volume.NewSpecFromPersistentVolume(pv, true), podC, &group)
	checkOptions(t, cOpts, map[string]string{"kubernetes.io/readwrite": "ro"})
	if !cMount.mounter.GetAttributes().ReadOnly {
		t.Error("read-only pod: GetAttributes().ReadOnly is false")
	}
	if got, err := os.ReadFile(filepath.Join(cMount.dir, "kh-data")); err != nil || string(got) != string(payload) {
		t.Fatalf("read-only pod reads %q, %v", got, err)
	}
	err = os.WriteFile(filepath.Join(cMount.dir, "kh-ro"), []byte("x"), 0o644)
	if !errors.Is(err, syscall.EROFS) {
		t.Errorf("read-only pod wrote to the volume (error %v, want EROFS)", err)
	}

	// Metrics: kubelet's statfs of the pod directory reports the volume's filesystem.
	metrics, err := a.mounter.GetMetrics()
	if err != nil {
		t.Fatalf("GetMetrics: %v (supportsMetrics not seen by the real code?)", err)
	}
	capacity := metrics.Capacity.Value()
	if capacity != statfsBytes(t, a.dir) || capacity < cfg.capacity*85/100 || capacity > cfg.capacity {
		t.Errorf("GetMetrics capacity %d; statfs %d; the volume is %d bytes", capacity, statfsBytes(t, a.dir), cfg.capacity)
	}
	t.Logf("metrics: capacity %d used %d available %d", capacity, metrics.Used.Value(), metrics.Available.Value())

	// NodeExpand: kubelet's online resize of a PV-backed, non-attachable volume:
	// expandfs <json> "" <pod dir> <new> <old>, the PV already carrying the new capacity.
	newSize := cfg.newSize
	grows := newSize > 0
	if !grows {
		newSize = cfg.capacity * 2
	}
	for _, argv := range cfg.grow {
		filled := make([]string, len(argv))
		for i, a := range argv {
			filled[i] = strings.ReplaceAll(a, "{size}", strconv.FormatInt(newSize, 10))
		}
		runArgv(t, filled)
	}
	grownPV := pv.DeepCopy()
	grownPV.Spec.Capacity[v1.ResourceStorage] = *resource.NewQuantity(newSize, resource.BinarySI)
	mark = k.rec.mark()
	ok, err = expander.NodeExpand(volume.NodeResizeOptions{
		VolumeSpec:      volume.NewSpecFromPersistentVolume(grownPV, false),
		DeviceMountPath: a.dir,
		NewSize:         *resource.NewQuantity(newSize, resource.BinarySI),
		OldSize:         *resource.NewQuantity(cfg.capacity, resource.BinarySI),
	})
	if err != nil || !ok {
		t.Fatalf("NodeExpand = %v, %v", ok, err)
	}
	c = k.oneCall(mark, "expandfs")
	wantTail := []string{"", a.dir, strconv.FormatInt(newSize, 10), strconv.FormatInt(cfg.capacity, 10)}
	if len(c.Argv) != 7 || strings.Join(c.Argv[3:], "|") != strings.Join(wantTail, "|") {
		t.Fatalf("expandfs argv %v, want tail %q", maskArgv(c.Argv), wantTail)
	}
	if grows {
		after := statfsBytes(t, b.dir)
		if after < newSize*85/100 || after <= capacity {
			t.Errorf("after NodeExpand to %d the filesystem is %d bytes (was %d)", newSize, after, capacity)
		}
		t.Logf("expanded: %d -> %d bytes", capacity, after)
	}

	// Inline volume: NewMounter for an inline spec; NodeExpand refuses it without a call.
	var d mounted
	if cfg.inlineOptions != nil {
		inline := e.inline("inline-kh", cfg.inlineOptions)
		podD := newPod("d")
		var dOpts map[string]string
		d, dOpts = k.setUp(inline, podD, &group)
		checkOptions(t, dOpts, map[string]string{"kubernetes.io/pvOrVolumeName": "inline-kh", "kubernetes.io/readwrite": "rw", "kubernetes.io/pod.uid": string(podD.UID)})
		if err := os.WriteFile(filepath.Join(d.dir, "kh-inline"), []byte("inline"), 0o644); err != nil {
			t.Fatalf("inline pod cannot write: %v", err)
		}
		mark = k.rec.mark()
		if _, err := expander.NodeExpand(volume.NodeResizeOptions{VolumeSpec: inline, DeviceMountPath: d.dir, NewSize: resource.MustParse("1Gi")}); err == nil {
			t.Error("NodeExpand of an inline volume succeeded")
		}
		k.noCalls(mark, "NodeExpand of an inline spec")
	}

	// Pods C and B go away.
	k.tearDown(pvName, podC, cMount.dir)
	k.tearDown(pvName, podB, b.dir)
	if got, err := os.ReadFile(filepath.Join(a.dir, "kh-data")); err != nil || string(got) != string(payload) {
		t.Fatalf("pod a lost its data when pods b and c left: %q, %v", got, err)
	}

	// kubelet restarts: a new prober and plugin manager (a fresh plugin instance, `init`
	// again); the volumes are reconstructed from the pod directories alone and torn down.
	k2 := e.start(t)
	if ops := k2.rec.ops(); len(ops) != 1 || ops[0] != "init" {
		t.Fatalf("restarted kubelet: want one init, got %v", ops)
	}
	for _, m := range []mounted{a, d} {
		if m.mounter == nil {
			continue
		}
		rv, err := k2.plugin.ConstructVolumeSpec(m.volName, m.dir)
		if err != nil || rv.Spec == nil || rv.Spec.Name() != m.volName {
			t.Fatalf("ConstructVolumeSpec(%s, %s) = %+v, %v", m.volName, m.dir, rv, err)
		}
		if !k2.plugin.CanSupport(rv.Spec) {
			t.Fatalf("the reconstructed spec is not flexhub's: %+v", rv.Spec.Volume)
		}
		k2.tearDown(rv.Spec.Name(), m.pod, m.dir)
	}

	// The data survives: a new pod mounts the volume through the restarted kubelet.
	podE := newPod("e")
	eMount, _ := k2.setUp(spec, podE, &group)
	if got, err := os.ReadFile(filepath.Join(eMount.dir, "kh-data")); err != nil || string(got) != string(payload) {
		t.Fatalf("after every pod left, a new pod reads %q, %v", got, err)
	}
	k2.tearDown(pvName, podE, eMount.dir)
	t.Logf("driver calls: first kubelet %v; restarted kubelet %v", k.rec.ops(), k2.rec.ops())
}
